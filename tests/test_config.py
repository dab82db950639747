"""Options declared once (`logitstore/options.py`) and config files: `--config FILE` (YAML or TOML) for
train and eval, flags over the file, `--print-config`, and the example in docs/configuration.md."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from logitstore import options
from logitstore.cli.app import app
from logitstore.options import declared, from_values, to_values
from logitstore.pipelines.config import BuildConfig
from logitstore.trainer.config import TrainConfig

runner = CliRunner()
ROOT = Path(__file__).parents[1]

TRAIN = dict(
    store="./store",
    out="./run",
    steps=7,
    lr=1e-3,
    loss="jsd",
    jsd_beta=0.3,
    teacher_weight=["a=0.7", "b=0.3"],
    report_to=["tensorboard"],
    offload_optimizer=True,
    global_batch_tokens=2048,
)


def flags(values: dict) -> list[str]:
    """`values` as command-line flags."""
    out = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, str(value)]
    return out


def printed(*args: str) -> dict:
    result = runner.invoke(app, [*args, "--print-config"])
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return yaml.safe_load(result.stdout)


def test_a_config_file_makes_the_run_its_flags_make(tmp_path):
    as_yaml, as_toml = tmp_path / "train.yaml", tmp_path / "train.toml"
    as_yaml.write_text(yaml.safe_dump(TRAIN))
    toml_lines = [f"{k.replace('_', '-')} = {v!r}".replace("True", "true").replace("'", '"') for k, v in TRAIN.items()]
    as_toml.write_text("\n".join(toml_lines) + "\n")

    from_flags = printed("train", *flags(TRAIN))
    assert printed("train", "--config", str(as_yaml)) == from_flags == printed("train", "--config", str(as_toml))
    assert from_flags["grad_accum"] == 2048 // (256 * 4)  # resolved: what --global-batch-tokens set
    cfg = from_values(TrainConfig, from_flags)
    assert cfg.run_identity() == from_values(TrainConfig, TRAIN).run_identity()
    assert cfg.data.teacher_weights == {"a": 0.7, "b": 0.3} and cfg.output.report_to == ("tensorboard",)
    assert printed("train", "--config", str(as_yaml)) == printed(
        "train", "--config", str(as_yaml), "--config", str(as_yaml)
    )


BUILD = dict(
    store="./store",
    teacher=["./teacher-a", "./teacher-b"],
    data="HuggingFaceFW/fineweb-edu",
    data_config="sample-10BT",
    top_p=0.9,
    top_k=32,
    value_grid="fine",
    student_tokenizer=["gpt2=./gpt2"],
    max_length=512,
    on_duplicate="replace",
)


def test_a_build_config_file_makes_the_build_its_flags_make(tmp_path):
    path = tmp_path / "build.toml"
    path.write_text(
        'store = "./store"\nteacher = ["./teacher-a", "./teacher-b"]\ndata = "HuggingFaceFW/fineweb-edu"\n'
        'data_config = "sample-10BT"\ntop-p = 0.9\ntop-k = 32\nvalue-grid = "fine"\n'
        'student_tokenizer = "gpt2=./gpt2"\nmax_length = 512\non_duplicate = "replace"\n'
    )
    from_flags = printed("build", *flags(BUILD))
    assert printed("build", "--config", str(path)) == from_flags
    assert from_flags["split"] == "train" and from_flags["teacher"] == BUILD["teacher"]  # resolved: a datasets name
    cfg = from_values(BuildConfig, {**from_flags, "teacher": None})
    assert (
        cfg.sparsity.mode == "topp"
        and cfg.sparsity.grid.fine_step == 0.002
        and cfg.student_tokenizers == ("gpt2=./gpt2",)
    )
    assert cfg.data.name == "HuggingFaceFW/fineweb-edu" and cfg.data.config == "sample-10BT"
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(from_flags))
    assert printed("build", "--config", str(again)) == from_flags
    assert printed("build", "--config", str(again), "--top-k", "16")["top_k"] == 16


def test_the_printed_configuration_makes_itself_again(tmp_path):
    live = ["--out", "r", "--live-teacher", "default", "--top-k", "8", "--data", "d.jsonl", "--seq-len", "64"]
    for args in (flags(TRAIN), live):
        first = printed("train", *args)
        path = tmp_path / "printed.yaml"
        path.write_text(yaml.safe_dump(first))
        assert printed("train", "--config", str(path)) == first
        cfg = from_values(TrainConfig, first)
        assert from_values(TrainConfig, to_values(cfg)) == cfg
    assert printed("train", *live)["top_k"] == 8 and printed("train", *live)["live_teacher"] == "default"


def test_flags_override_the_file_and_the_file_the_defaults(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("store: ./store\nout: ./run\nlr: 3e-4\nseq-len: 128\n")  # YAML reads 3e-4 as a string
    values = printed("train", "--config", str(path), "--lr", "0.01")
    assert values["lr"] == 0.01 and values["seq_len"] == 128 and values["micro_batch"] == 4
    assert printed("train", "--config", str(path))["lr"] == 3e-4
    eval_file = tmp_path / "eval.toml"
    eval_file.write_text('store = "./store"\nstudent = "./run/final"\neval_fraction = 1\n')
    values = printed("eval", "--config", str(eval_file), "--seq-len", "64")
    assert values == {
        "store": "./store",
        "student": "./run/final",
        "version": None,
        "teacher": None,
        "seq_len": 64,
        "eval_fraction": 1.0,
        "train_on": "completion",
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lrr: 0.1\n", "unknown key 'lrr': `logitstore train` has no --lrr (did you mean 'lr'?)"),
        ("steps: many\n", "steps: invalid literal for int()"),
        ("loss: kl\n", "loss: 'kl' is not one of forward_kl, topk_renorm, reverse_kl, jsd"),
        ("resume: yes please\n", "resume: expected true or false"),
        ("- a list\n", "expected a mapping of flag names to values, got list"),
        ("out: [\n", "not valid YAML"),
    ],
)
def test_a_bad_config_file_is_one_line_naming_the_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = runner.invoke(app, ["train", "--config", str(path), "--store", "s", "--out", "o"])
    assert result.exit_code == 2 and result.stderr.startswith(f"error: --config {path}: {message}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def one_line(result, code: int = 2) -> str:
    assert result.exit_code == code and len(result.stderr.strip().splitlines()) == 1, (result.exit_code, result.stderr)
    return result.stderr.strip()


@pytest.mark.parametrize(
    ("key", "flag"),
    [("json", "--json"), ("dry_run", "--dry-run"), ("print-config", "--print-config"), ("config", "--config")],
)
def test_a_command_line_flag_in_a_config_file_is_refused_as_such(tmp_path, key, flag):
    path = tmp_path / "build.yaml"
    path.write_text(f"store: ./store\n{key}: true\n")
    error = one_line(runner.invoke(app, ["build", "--config", str(path), "--print-config"]))
    assert error == f"error: --config {path}: {key!r} is not allowed in a config file ({flag} is a command-line flag)"


def train_config_error(path, text: str) -> str:
    """The one line `train --config path --print-config` refuses `text` in `path` with."""
    path.write_text(text)
    return one_line(
        runner.invoke(app, ["train", "--config", str(path), "--store", "s", "--out", "o", "--print-config"])
    )


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_a_key_given_twice_is_refused_naming_it(tmp_path, suffix):
    text = "lr: 0.001\nsteps: 5\nlr: 0.1\n" if suffix == ".yaml" else '{"lr": 0.001,\n"lr": 0.1}\n'
    error = train_config_error(tmp_path / f"train{suffix}", text)
    assert error.endswith("key 'lr' is given twice (lines 1 and 3)" if suffix == ".yaml" else "(lines 1 and 2)"), error
    merged = tmp_path / "merged.yaml"  # a merge key's values may be given again: the mapping's own win
    merged.write_text("base: &base {lr: 0.001, steps: 5}\nrun:\n  <<: *base\n  lr: 0.1\n")
    assert yaml.load(merged.read_text(), Loader=options._Loader)["run"] == {"lr": 0.1, "steps": 5}


@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_a_key_given_twice_as_its_two_spellings_is_refused(tmp_path, suffix):
    """`seq_len` and `seq-len` name one flag: given both, neither silently wins."""
    path = tmp_path / f"train{suffix}"
    text = "seq_len: 3\nseq-len: 5\n" if suffix == ".yaml" else 'seq_len = 3\n"seq-len" = 5\n'
    error = train_config_error(path, text)
    assert error == f"error: --config {path}: key 'seq-len' is given twice (also as 'seq_len')"


def test_a_billion_laughs_config_is_one_short_line(tmp_path):
    levels = ["- &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    # 9**6 items from six lines (a real attack nests deeper: the cost of quoting it whole grows 9x a line)
    levels += [f"- &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 6)]
    path = tmp_path / "laughs.yaml"
    path.write_text("seq_len:\n" + "\n".join(levels) + "\n")
    error = one_line(runner.invoke(app, ["train", "--config", str(path), "--store", "s", "--out", "o"]))
    assert error.startswith(f"error: --config {path}: seq_len: expected int, got [[") and len(error) < 400, error


def test_a_required_flag_may_come_from_the_file_and_missing_is_one_line(tmp_path):
    result = runner.invoke(app, ["train", "--store", "s"])
    assert result.exit_code == 2 and result.stderr == "error: --out is required (a flag, or a key of --config)\n"
    result = runner.invoke(app, ["eval"])
    assert result.exit_code == 2 and "--store and --student are required" in result.stderr
    path = tmp_path / "eval.yaml"
    path.write_text("student: ./final\n")
    assert printed("eval", "--config", str(path), "--store", "s")["student"] == "./final"


def test_config_file_errors_come_before_torch(tmp_path):
    # Order, not time: the child says whether torch had been imported when the one-line error came.
    code = (
        "import sys\n"
        "from logitstore.cli.app import main\n"
        "try:\n    main()\n"
        "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)\n"
    )
    bad = tmp_path / "bad.toml"
    bad.write_text('store = "s"\nwarmup = 3\n')
    for command in (["train", "--out", "o"], ["eval", "--student", "x"], ["build"]):
        child = subprocess.run(
            [sys.executable, "-c", code, *command, "--config", str(bad)], capture_output=True, text=True, timeout=120
        )
        assert child.stdout.strip() == "exit 2 False", (command, child.stdout, child.stderr)
        assert child.stderr.startswith(f"error: --config {bad}: unknown key 'warmup'")
        assert len(child.stderr.strip().splitlines()) == 1


def test_each_flag_is_declared_once_and_config_modules_import_no_torch(tmp_path):
    assert len(declared(TrainConfig)) == 56 and len(declared(BuildConfig)) == 45  # each name once (asserted)
    result = runner.invoke(app, ["build", "--data", str(tmp_path / "nowhere.jsonl")])
    assert result.exit_code == 2 and result.stderr == "error: --store is required (a flag, or a key of --config)\n"
    code = "import sys, logitstore.cli.app; print(sorted({'torch', 'numba', 'transformers'} & set(sys.modules)))"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert child.stdout.strip() == "[]", child.stdout


def test_the_configuration_page_examples_load(tmp_path):
    """docs/configuration.md's example files are whole configurations: each loads, and sets what it says."""
    page = (ROOT / "docs" / "configuration.md").read_text()
    blocks = {name: text for _, name, text in re.findall(r"```(yaml|toml)\n# (\S+)\n(.*?)```", page, flags=re.S)}
    assert set(blocks) == {"train.yaml", "eval.yaml", "build.toml"}, blocks.keys()
    for name, text in blocks.items():
        path = tmp_path / name
        path.write_text(text)
        command = name.split(".")[0]
        values = printed(command, "--config", str(path))
        written = yaml.safe_load(text) if name.endswith(".yaml") else tomllib.loads(text)
        assert {k.replace("-", "_") for k in written} <= set(values)
        assert all(values[k.replace("-", "_")] == v or isinstance(v, list) for k, v in written.items())
    assert len(yaml.safe_load(blocks["train.yaml"])) == len(declared(TrainConfig))  # every option, once
