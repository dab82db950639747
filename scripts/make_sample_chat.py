"""Build logitstore/data/sample_chat.jsonl: a small chat sample for the quick start and tests.

Conversations about the Python standard library, written for logitstore (no outside text), in the
OpenAI / Hugging Face `messages` format: one {"id", "messages"} object per line. Some have a system
message, some several turns, so the loss mask has prompts and completions of every shape.

    python scripts/make_sample_chat.py
"""

import json
from pathlib import Path

SYSTEM = "You are a concise assistant who answers questions about Python."

QA = [
    (
        "How do I read a JSON file in Python?",
        'Open the file and pass it to json.load:\n\nimport json\nwith open("data.json") as f:\n    data = json.load(f)\n\n'
        "json.load returns dicts, lists, strings, numbers, booleans and None.",
    ),
    (
        "What is the difference between a list and a tuple?",
        "A list is mutable: you can append, remove and reassign items. A tuple is immutable once created, "
        "so it can be a dictionary key or a set member when its items are hashable.",
    ),
    (
        "How can I get the current date?",
        "Use datetime.date.today() for the date, or datetime.datetime.now() for the date and time. "
        "For a time zone aware value, pass a tz, for example datetime.datetime.now(datetime.timezone.utc).",
    ),
    (
        "What does the pathlib module do?",
        'pathlib represents file system paths as objects. Path("a") / "b" joins paths, .exists() checks a path, '
        '.read_text() reads a file, and .glob("*.py") lists matching files.',
    ),
    (
        "How do I count how often each word appears in a list?",
        "collections.Counter does it in one line: Counter(words). Its most_common(3) method returns the three "
        "most frequent words with their counts.",
    ),
    (
        "Why should I use a virtual environment?",
        "A virtual environment keeps each project's packages apart, so upgrading a package for one project "
        "cannot break another. Create one with python -m venv .venv and activate it before installing.",
    ),
    (
        "How do I sort a list of dictionaries by a key?",
        'Pass a key function to sorted: sorted(rows, key=lambda r: r["age"]). operator.itemgetter("age") '
        "does the same and is a little faster. Add reverse=True for descending order.",
    ),
    (
        "What is a generator?",
        "A generator is a function that uses yield. Calling it returns an iterator that produces values one "
        "at a time, on demand, so it can walk a large file or an endless sequence without holding it in memory.",
    ),
    (
        "How do I run a shell command and capture its output?",
        'Use subprocess.run with capture_output=True and text=True:\n\nresult = subprocess.run(["ls", "-l"], '
        "capture_output=True, text=True)\nprint(result.stdout)\n\nPass check=True to raise on a non-zero exit.",
    ),
    (
        "What is the walrus operator?",
        "The := operator assigns a value inside an expression, for example while (line := f.readline()): ... "
        "It arrived in Python 3.8.",
    ),
    (
        "How do I measure how long a piece of code takes?",
        "For a quick number, time.perf_counter() before and after. For a small snippet, the timeit module runs "
        "it many times and reports the best, which removes most of the noise.",
    ),
    (
        "What does functools.lru_cache do?",
        "It remembers a function's results by its arguments, so a repeated call returns the stored result "
        "instead of computing it again. maxsize bounds how many results it keeps.",
    ),
    (
        "How can I merge two dictionaries?",
        "Since Python 3.9, a | b returns a new dictionary with the keys of both; values from b win. "
        "a |= b updates a in place.",
    ),
    (
        "What is the difference between == and is?",
        "== compares values, is compares identity: whether both names refer to the same object. "
        "Use is for None, and == for everything else.",
    ),
    (
        "How do I write a CSV file?",
        'Use csv.writer on a file opened with newline="":\n\nwith open("out.csv", "w", newline="") as f:\n'
        "    csv.writer(f).writerows(rows)\n\ncsv.DictWriter writes dictionaries with a header row.",
    ),
    (
        "What are f-strings?",
        'Formatted string literals: f"{name} is {age} years old" puts the values of expressions into the '
        'string. A format spec follows a colon, as in f"{price:.2f}".',
    ),
    (
        "How do I make an HTTP request with only the standard library?",
        "urllib.request.urlopen(url) returns a response whose read() gives the body as bytes. "
        "For JSON, json.load(response) parses it directly.",
    ),
    (
        "What is a dataclass?",
        "A class decorated with @dataclasses.dataclass gets __init__, __repr__ and __eq__ written for it from "
        "its annotated fields. frozen=True makes instances immutable.",
    ),
    (
        "How do I handle an exception and still clean up?",
        "Put the cleanup in a finally block, which runs whether or not the try block raised. "
        "For files and locks, a with statement does the cleanup for you.",
    ),
    (
        "How can I remove duplicates from a list but keep the order?",
        "list(dict.fromkeys(items)) keeps the first occurrence of each item in order, because dictionaries "
        "remember insertion order.",
    ),
]

FOLLOW_UPS = [
    (
        "Thanks! Is that fast for big inputs?",
        "Yes for most uses: it runs in C and takes time linear in the size of the input.",
    ),
    (
        "Can you show a one-line example?",
        "Certainly. Try it in the interpreter with a small input first, then use it in your code.",
    ),
    (
        "Does this work in Python 3.8?",
        'Mostly. Check the documentation\'s "changed in version" notes for the parts added later.',
    ),
]


def conversations() -> list[dict]:
    out = []
    for i, (question, answer) in enumerate(QA):
        messages = [{"role": "system", "content": SYSTEM}] if i % 2 == 0 else []
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if i % 3 == 0:
            follow_q, follow_a = FOLLOW_UPS[(i // 3) % len(FOLLOW_UPS)]
            messages += [{"role": "user", "content": follow_q}, {"role": "assistant", "content": follow_a}]
        out.append({"id": f"chat-{i:03d}", "messages": messages})
    return out


if __name__ == "__main__":
    path = Path(__file__).resolve().parents[1] / "logitstore" / "data" / "sample_chat.jsonl"
    rows = conversations()
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{path}: {len(rows)} conversations")
