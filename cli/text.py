"""What the commands print when not asked for `--json`: one function per command's text output, each
taking what the library returned. Cheap to import (typer only); `cli/app.py` calls these after the
command's work is done."""

from __future__ import annotations

import json
import math
import time

import typer


def print_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


def print_info(summary: dict) -> None:
    """`info`: the version's totals, then per teacher its vocabulary, sparsity and codec."""
    bpt = summary["bytes_per_token"]
    typer.echo(f"version      {summary['version']}")
    typer.echo(f"samples      {summary['samples']:,}")
    typer.echo(f"tokens       {summary['tokens']:,}")
    typer.echo(f"stored       {summary['stored_bytes']:,} bytes ({'-' if bpt is None else f'{bpt:.1f}'} bytes/token)")
    typer.echo(f"index        {summary['index_path'] or '-'}")
    for t in summary["teachers"]:
        params = ", ".join(f"{k}={v}" for k, v in t["sparsity"].items() if k != "mode" and v is not None)
        typer.echo(
            f"teacher      {t['name']}: vocab {t['vocab_size']:,}, {t['sparsity_mode']} ({params}), "
            f"{t['samples']:,} samples, codec error bound {t['codec']['error_bound_fine']} / {t['codec']['error_bound']} nats"
            + (f", {t['engine']} engine in {t['dtype']}" if t["engine"] else "")
        )
        for st in t["student_tokenizers"]:
            mass = "-" if st["mapped_mass"] is None else f"{st['mapped_mass']:.1%}"
            typer.echo(
                f"  student    {st['name']}: vocab {st['vocab_size']:,}, {st['mapped_ids']:,} teacher ids map exactly, "
                f"carrying {mass} of the teacher's probability mass"
            )


def print_alignment(obj: dict, *, student_tokenizer: str) -> None:
    """`show --student-tokenizer`: the sample's teacher tokens beside the student tokenizer's, by group."""
    tokens = obj.get("tokens") or [str(t) for t in obj["input_ids"]]
    typer.echo(
        f"sample {obj['sample_id']}: {len(obj['input_ids'])} teacher tokens, {len(obj['student_ids'])} "
        f"{student_tokenizer} tokens, {len(obj['alignment'])} aligned groups"
    )
    for t0, t1, s0, s1 in obj["alignment"]:
        typer.echo(f"  {tokens[t0:t1]!r:>40} = {obj['student_tokens'][s0:s1]!r}")


def print_sample(obj: dict, *, first: int, top: int) -> None:
    """`show`: per position (from `first`), the token, the next one, the target's probability, the tail
    and the `top` entries."""
    tokens = obj.get("tokens") or [str(t) for t in obj["input_ids"]]
    typer.echo(f"sample {obj['sample_id']}: {len(obj['input_ids'])} tokens (teacher {obj['teacher']})")
    if "answer" in obj:
        a, g = obj["answer"], obj["answer"]["generation"]
        who = g.get("generator", {}).get("name", "?") + (f", round {g['round']}" if g.get("round") is not None else "")
        typer.echo(f"answer {a['sample']} to prompt {a['prompt_id']!r} by {who}: {a['text']!r}")
    for k, pos in enumerate(obj["positions"]):
        t = first + k
        names = obj.get("entry_tokens", [None] * len(obj["positions"]))[k] or [str(i) for i in pos["ids"]]
        entries = "  ".join(f"{n!r}:{math.exp(lp):.3f}" for n, lp in list(zip(names, pos["logprobs"]))[:top])
        typer.echo(
            f"{t:5d} {tokens[t]!r:>14} -> {tokens[t + 1]!r:<14} target p={math.exp(pos['target_logprob']):.3f} "
            f"tail={pos['tail']:.3f} | {entries}"
        )


def print_samples(rows: list[dict], *, total: int) -> None:
    """`ls`: a table of the samples, and on stderr how many of the `total` it lists."""
    width = max([len("sample_id"), *(len(r["sample_id"]) for r in rows)])
    typer.echo(f"{'sample_id':<{width}}  {'tokens':>7}  teacher")
    for r in rows:
        typer.echo(f"{r['sample_id']:<{width}}  {r['tokens']:>7,}  {r['teacher']}")
    shown = f"{len(rows):,} of {total:,}" if len(rows) < total else f"{len(rows):,}"
    typer.echo(f"{shown} samples", err=True)


def print_log(versions: list) -> None:
    for v in versions:
        tags = f" [{', '.join(v.tags)}]" if v.tags else ""
        size = f"{v.samples:>8,} samples {v.tokens:>11,} tokens" if v.samples is not None else " " * 36
        typer.echo(f"{v.id}  {v.written_at:%Y-%m-%d %H:%M:%S}  {size}  {v.message}{tags}")


def print_diff(changes: dict) -> None:
    for kind, mark in (("added", "+"), ("removed", "-"), ("changed", "~")):
        for item in changes[kind]:
            typer.echo(f"{mark} {item['teacher']}/{item['sample_id']}")
    typer.echo(f"{len(changes['added'])} added, {len(changes['removed'])} removed, {len(changes['changed'])} changed")


def print_export(summary: dict) -> None:
    """`export`: one line; a note on stderr for answers whose prompt the store did not keep."""
    if summary["prompts_not_stored"]:
        typer.echo(
            f"note: {summary['prompts_not_stored']} answer(s) were stored before prompts were kept: their user "
            "turn is the prompt's text as the teacher's tokenizer decodes it",
            err=True,
        )
    typer.echo(
        f"wrote {summary['answers']} answers to {summary['prompts']} prompts of teacher {summary['teacher']} "
        f"(version {summary['version']}) as chat rows to {summary['out']}"
    )


def print_entries_export(summary: dict) -> None:
    """`export --what entries`: one line."""
    rate = summary["tokens_per_second"]
    typer.echo(
        f"wrote {summary['positions']:,} positions of {summary['samples']:,} samples of teacher {summary['teacher']} "
        f"(version {summary['version']}) to {summary['out']} in {summary['seconds']:.1f} s"
        + (f" ({rate:,.0f} tokens/s)" if rate else "")
    )


class ProgressLines:
    """A long command's progress on stderr: `progress(done, total)` in tokens prints a line with the
    tokens/s so far at most every `every` seconds, and one at the end."""

    def __init__(self, what: str, *, every: float = 5.0):
        self.what, self.every = what, every
        self.start = self.last = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < self.every and done < total:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        share = f" ({done / total:.0%})" if total else ""
        typer.echo(f"{self.what}: {done:,} of {total:,} tokens{share}, {rate:,.0f} tokens/s", err=True)


def verify_json(report) -> dict:
    return {
        "version": report.version,
        "ok": report.ok,
        "samples": report.samples,
        "damaged": report.damaged,
        "arrays": report.arrays,
        "damaged_arrays": report.damaged_arrays,
        "unreferenced_parts": report.unreferenced,
    }


def print_verify(report) -> None:
    """`verify`: ok, or each damaged sample and array on stderr; parts no sample reads as a note."""
    if report.unreferenced:  # not damage: what older versions read, or a concurrent build's leftovers
        typer.echo(
            f"note: {len(report.unreferenced)} part(s), {sum(report.unreferenced.values()):,} bytes, hold no "
            "sample of this version (replaced or removed documents' windows, which older versions still read)",
            err=True,
        )
    if report.ok:
        typer.echo(
            f"ok: version {report.version}, {report.samples} samples in {report.parts} parts and "
            f"{report.arrays} teacher arrays are whole"
        )
        return
    for what, problem in sorted(report.damaged_arrays.items()) + sorted(report.damaged.items()):
        typer.echo(f"damaged: {what}: {problem}", err=True)
    typer.echo(
        f"{len(report.damaged)} of {report.samples} samples and {len(report.damaged_arrays)} of "
        f"{report.arrays} teacher arrays damaged in version {report.version}",
        err=True,
    )


def print_build(summary, cfg) -> None:
    """`build`: the version made, its totals and speed, and what was skipped, changed or generated."""
    typer.echo(
        (f"version {summary.version}" if summary.version else "nothing stored (no store or branch made)")
        + f": {summary.samples:,} samples, {summary.tokens:,} tokens in "
        f"{summary.seconds:.1f} s ({summary.tokens_per_second:,.0f} tokens/s), "
        f"{summary.bytes_per_token or 0:.1f} bytes/token; skipped {summary.skipped}, "
        f"duplicates {summary.duplicates}, already stored {summary.already_stored}"
        + (f", changed {summary.changed} ({cfg.on_duplicate})" if summary.changed else "")
        + (f", no assistant tokens {summary.no_completion}" if summary.no_completion else "")
        + (f", tool calls the template drops {summary.tool_calls}" if summary.tool_calls else "")
        + (
            f"; generated {summary.answers:,} answers to {summary.prompts:,} prompts, "
            f"{summary.generated_tokens:,} tokens, {summary.answers_cut:,} cut at --generate {cfg.generate}"
            + (f", {summary.answers_retokenized:,} re-tokenized" if summary.answers_retokenized else "")
            + (f", {summary.answers_empty:,} empty (not stored)" if summary.answers_empty else "")
            if cfg.generate
            else ""
        )
    )


def print_estimates(estimates: list) -> None:
    """`build --dry-run`: one estimate per teacher (`pipelines/estimate.py`)."""
    from logitstore.sizes import format_bytes

    for e in estimates:
        scaled = (
            "all tokenized"
            if e.exact
            else f"the first {e.tokenized_documents:,} tokenized, the rest scaled by {'count' if e.generation else 'size'}"
        )
        bpt = "-" if e.bytes_per_token is None else f"{e.bytes_per_token:.1f}"
        params = ", ".join(f"{k}={v}" for k, v in e.sparsity.items() if k != "mode" and v is not None)
        typer.echo(f"dry run, teacher {e.teacher} (nothing written):")
        typer.echo(f"  input    {e.documents:,} documents ({scaled})")
        typer.echo(
            f"  compute  ~{e.tokens:,} tokens in ~{e.samples:,} samples (already stored: {e.already_stored:,} samples)"
        )
        typer.echo(
            f"  store    ~{format_bytes(e.stored_bytes)}: {bpt} bytes/token ({e.sparsity['mode']} {params}), "
            f"measured on {e.measured_tokens:,} tokens"
        )
        if e.generation is not None:
            typer.echo(f"  generate {_generation_estimate(e)}")
        typer.echo(
            f"  time     ~{e.seconds / 60:.1f} min on this machine: teacher load {e.load_seconds:.1f} s, then "
            f"{e.teacher_tokens_per_second:,.0f} tokens/s (one worker)"
            + (f", generation ~{e.generation_seconds / 60:.1f} min of it" if e.generation_seconds else "")
        )


def _generation_estimate(e) -> str:
    """A dry run's generation line: answers, their tokens and time, and the bytes they take."""
    from logitstore.sizes import format_bytes

    if e.answers_of is not None:
        return f"none: scores the answers teacher {e.answers_of} generates ({e.answers_per_prompt} per prompt)"
    bound = e.measured_answers == 0
    mean = f"at most {e.mean_answer_tokens:,.0f}" if bound else f"{e.mean_answer_tokens:,.1f}"
    rate = f"{e.generator_tokens_per_second:,.0f} tokens/s" if e.generator_tokens_per_second else "- tokens/s"
    return (
        f"~{e.answers:,} answers ({e.answers_per_prompt} per prompt to ~{e.prompts:,} prompts), "
        f"~{e.generated_tokens:,} tokens ({mean} per answer, measured on {e.measured_answers:,} answers; "
        f"~{e.answers_cut:,} cut), ~{e.generation_seconds / 60:.1f} min at {rate}; "
        f"answers stored ~{format_bytes(e.answer_stored_bytes)}"
    )


def print_dry_run(cfg, teachers: list, *, json_out: bool) -> None:
    """`build --dry-run`: one estimate per teacher (`pipelines/estimate.py`)."""
    from logitstore.pipelines.estimate import estimate_builds  # the build's modules: torch, seconds to import

    estimates = estimate_builds(cfg, teachers, log=lambda line: typer.echo(line, err=True))
    if json_out:
        print_json({"dry_run": True, "teachers": [e.to_json() for e in estimates]})
    else:
        print_estimates(estimates)
