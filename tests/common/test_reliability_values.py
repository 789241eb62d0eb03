"""Issue 42 (reliability round 5), rows 3-5: the reader gives back only what can be used later.
Text that does not encode as UTF-8 (a lone surrogate from a `\\ud800` escape) or holds NUL, finite
numbers whose arithmetic overflows (5e-324 samples/s, a price of 1e-320, `--max-size 1e308T`),
YAML integers by YAML 1.2 (`010000` is 10000) and keys given twice: one line naming the field, exit
2, nothing made. In-process through `neuron_train.cli.main`.
"""

from __future__ import annotations

import json

import pytest

from neuron_train import cli
from neuron_train.common import reader
from neuron_train.common.errors import UsageError
from neuron_train.precompile import store
from tests.conftest import FAST, NANO
from tests.cost.test_report_reliability import result
from tests.precompile.test_reliability_cache import make_cache, manifest_json, record


@pytest.fixture(autouse=True)
def _clean_env(in_process_cli, monkeypatch, tmp_path):
    """No launcher variables in the in-process CLI runs; no AWS look-ups from `report`."""
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))


def run(capsys, *argv) -> tuple[int, str]:
    code = cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and len(err) < 800, err[:2000]
    return code, err


# ----------------------------------------------------------------------------- YAML 1.2 integers


@pytest.mark.parametrize("text, value", [("010000", 10000), ("0100", 100), ("0o10000", 4096), ("0x1F", 31),
                                         ("-12", -12), ("+7", 7), ("1_000", 1000), ("0", 0), ("1:20", "1:20")])
def test_yaml_integers_are_read_as_yaml_1_2_writes_them(text, value):
    """Bad row 5: `batch_size: 010000` was octal 4096, `max_steps: 0100` trained 64 steps (YAML 1.1)."""
    assert reader.parse(f"n: {text}\n", "yaml", "c.yaml") == {"n": value}


def test_a_leading_zero_is_a_decimal_in_a_run_config(tmp_path):
    from neuron_train.training.config_io import build_config, load_config_file

    path = tmp_path / "c.yaml"
    path.write_text("train:\n  batch_size: 010000\n  max_steps: 0100\n")
    cfg = build_config(load_config_file(str(path)))
    assert (cfg.train.batch_size, cfg.train.max_steps) == (10000, 100)


# ----------------------------------------------------------------------------- keys given twice


@pytest.mark.parametrize("name, text, line", [
    ("key.yaml", "train:\n  batch_size: 8\n  batch_size: 16\n", "line 3: the key 'batch_size' is given twice"),
    ("section.yaml", "train:\n  batch_size: 8\noptim:\n  lr: 0.1\ntrain:\n  max_steps: 2\n",
     "line 5: the key 'train' is given twice"),
    ("key.toml", "[train]\nbatch_size = 8\nbatch_size = 16\n", "Cannot overwrite a value (at line 3"),
])
def test_a_key_or_section_given_twice_is_one_line(tmp_path, capsys, name, text, line):
    """YAML kept the last silently, where TOML refuses."""
    path = tmp_path / name
    path.write_text(text)
    code, err = run(capsys, "train", "--config", path, "--output-dir", tmp_path / "run", *NANO, *FAST)
    assert code == 2 and line in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, text", [
    ("prices.json", '{"prices": [{"instance_type": "trn1.2xlarge", "usd_per_hour": 1.3, "usd_per_hour": 0.1,'
                    ' "region": "r", "date": "2026-01-01", "source": "me"}]}'),
    ("prices.yaml", "prices:\n- instance_type: trn1.2xlarge\n  usd_per_hour: 1.3\n  usd_per_hour: 0.1\n"
                    "  region: r\n  date: '2026-01-01'\n  source: me\n"),
])
def test_a_price_given_twice_is_one_line(tmp_path, capsys, name, text):
    """Weak row: duplicate keys in a price file (the last one won)."""
    prices = tmp_path / name
    prices.write_text(text)
    code, err = run(capsys, "report", result(tmp_path), "--prices", prices, "--out", tmp_path / "rep")
    assert code == 2 and "'usd_per_hour' is given twice" in err and str(prices) in err
    assert not (tmp_path / "rep").exists()


# ----------------------------------------------------------------------------- text Python cannot use


@pytest.mark.parametrize("name, text, field, problem", [
    ("surrogate.yaml", 'train:\n  output_dir: "run\\ud800"\n', "train.output_dir", "lone surrogate"),
    ("surrogate.json.yaml", '{"train": {"output_dir": "run\\ud800"}}', "train.output_dir", "lone surrogate"),
    ("nul.toml", '[train]\noutput_dir = "run\\u0000x"\n', "train.output_dir", "NUL"),
    ("nul.yaml", 'train:\n  output_dir: "run\\0x"\n', "train.output_dir", "NUL"),
    ("key.yaml", 'train:\n  "\\ud800": 1\n', "train: a key", "lone surrogate"),
])
def test_text_no_name_can_hold_is_refused_naming_the_field(tmp_path, capsys, monkeypatch, name, text, field,
                                                           problem):
    """Bad row 3: a lone surrogate in a YAML output_dir, a NUL in a TOML one: tracebacks in `train`."""
    monkeypatch.chdir(tmp_path)  # a default run folder would be made here
    path = tmp_path / name
    path.write_text(text)
    code, err = run(capsys, "train", "--config", path, *NANO, *FAST)
    assert code == 2 and f"{field}: " in err and problem in err
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("field, value", [("model__name", "vit\ud800"), ("instance_type", "trn1\ud800"),
                                          ("model__name", "vit\x00nano")])
def test_a_result_name_that_is_not_text_is_refused_before_the_report(tmp_path, capsys, field, value):
    """Bad row 3: a lone surrogate in a model or host name crashed matplotlib in `report`."""
    bad = result(tmp_path, "bad.json", **{field: value})
    code, err = run(capsys, "report", bad, "--out", tmp_path / "rep")
    assert code == 2 and f"{bad}: {field.replace('__', '.')}: " in err
    assert not (tmp_path / "rep").exists()


def test_a_manifest_key_that_is_not_text_is_one_line(tmp_path, capsys):
    """Bad row 3: a lone surrogate in a manifest key was a traceback in `cache verify`."""
    cache = make_cache(tmp_path / "c", {"a/model.neff": b"x"})
    manifest = manifest_json({"a/model.neff": record(b"x"), "a/b\ud800.neff": record(b"y")})
    (cache / store.MANIFEST).write_text(json.dumps(manifest))
    code, err = run(capsys, "cache", "verify", "--cache-dir", cache)
    assert code != 0 and "files: a key: " in err and "lone surrogate" in err


# ----------------------------------------------------------------------------- numbers that overflow later


@pytest.mark.parametrize("value", [5e-324, 1e-320, 1e300])
def test_a_throughput_whose_arithmetic_overflows_is_refused_naming_it(tmp_path, capsys, value):
    """Bad row 4: samples_per_sec 5e-324 made the report's axis limits NaN/Inf (a traceback)."""
    bad = result(tmp_path, "bad.json", samples_per_sec__median=value)
    code, err = run(capsys, "report", result(tmp_path, "good.json"), bad, "--out", tmp_path / "rep")
    assert code == 2 and f"{bad}: samples_per_sec.median: {value!r} is not a value any field takes" in err
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize("name, text", [
    ("prices.yaml", "prices:\n- {instance_type: trn1.2xlarge, usd_per_hour: 1e-320, region: r, date: d, source: s}\n"),
    ("prices.csv", "instance_type,usd_per_hour,region,date,source\ntrn1.2xlarge,1e-320,r,2026-01-01,me\n"),
])
def test_a_price_whose_arithmetic_overflows_is_refused_naming_it(tmp_path, capsys, name, text):
    """Bad row 4: a price of 1e-320 (the CSV path is checked by the field table, not the parser)."""
    prices = tmp_path / name
    prices.write_text(text)
    code, err = run(capsys, "report", result(tmp_path), "--prices", prices, "--out", tmp_path / "rep")
    assert code == 2 and "usd_per_hour" in err and "1e-320 is not a value any field takes" in err
    assert not (tmp_path / "rep").exists()


def test_a_max_size_beyond_any_disk_is_one_line(tmp_path, capsys):
    """Bad row 4: `cache prune --max-size 1e308T` was an OverflowError."""
    cache = make_cache(tmp_path / "c", {})
    code, err = run(capsys, "cache", "prune", "--cache-dir", cache, "--max-size", "1e308T")
    assert code == 2 and "--max-size: '1e308T' is more bytes than any disk holds" in err


@pytest.mark.parametrize("sign", ["", "-"])
def test_an_integer_of_400_digits_is_refused_either_sign(sign):
    """Item 7: a huge negative integer passed the integer bound (mutant: `node >=` for `abs(node) >=`)."""
    with pytest.raises(UsageError, match="optim.lr: an integer of 400 digits"):
        reader.parse(f"optim:\n  lr: {sign}{'9' * 400}\n", "yaml", "c.yaml")


def test_link_image_and_newline_in_a_name_are_text_in_report_md(tmp_path, capsys):
    """Weak row: a model name holding `![x](http://...)` was an image in report.md (a request to
    that host when the file is viewed), one holding a newline broke the table row."""
    name = "vit ![pixel](http://example.invalid/p.png) [click](http://example.invalid)\n| injected | row |"
    code = cli.main(["report", str(result(tmp_path, model__name=name)), "--out", str(tmp_path / "rep")])
    err = capsys.readouterr().err
    assert code == 0, err
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "](http://example.invalid" in md  # the name is there, as text
    assert "![pixel](" not in md and "[click](" not in md and "\\[click\\](" in md
    assert not any(line.startswith("| injected") for line in md.splitlines())
