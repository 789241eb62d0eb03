"""`neuron-train report`: merging, price-performance arithmetic, provenance, refusals, rendering."""

from __future__ import annotations

import copy
import csv
import datetime as dt
import json
from pathlib import Path

import boto3
import pytest
from botocore.stub import ANY, Stubber

from neuron_train import cli
from neuron_train.common.errors import RunError, UsageError
from neuron_train.cost.catalog import apply_price_file, live_prices, load_catalog
from neuron_train.cost.report.references import read_reference_csv
from neuron_train.cost.schema import validate_result
from tests.conftest import ROOT

FIX = ROOT / "tests" / "fixtures" / "report"
INFER = json.loads((FIX / "cpu_infer_vit_digits.json").read_text())
TRAIN = json.loads((FIX / "cpu_train_vit_digits.json").read_text())


@pytest.fixture(autouse=True)
def _no_aws(monkeypatch, tmp_path):
    """No test may reach AWS or the EC2 metadata service."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))


def result(tmp_path: Path, name: str, base: dict = INFER, *, instance: str, sps: float,
           **top: object) -> Path:
    """A copy of a real CPU result with a chosen instance type and throughput (for arithmetic)."""
    r = copy.deepcopy(base)
    r["instance_type"] = instance
    r["samples_per_sec"] = {"median": sps, "spread": 0.0, "values": [sps] * r["repeats"]}
    for key, value in top.items():
        r[key] = value
    path = tmp_path / name
    path.write_text(json.dumps(r))
    return path


def run_report(*argv: object) -> int:
    return cli.main(["report", *map(str, argv)])


def read_csv(out: Path) -> list[dict]:
    with (out / "report.csv").open() as fh:
        return list(csv.DictReader(fh))


def test_fixtures_are_valid_results():
    validate_result(INFER, "infer fixture")
    validate_result(TRAIN, "train fixture")


def test_samples_per_dollar_relative_and_costs_match_hand_computation(tmp_path):
    a = result(tmp_path, "trn1.json", instance="trn1.2xlarge", sps=1000.0)
    b = result(tmp_path, "inf2.json", instance="inf2.xlarge", sps=800.0)
    out = tmp_path / "rep"
    assert run_report(a, b, "--out", out) == 0
    rows = {r["instance_type"]: r for r in read_csv(out)}
    trn1, inf2 = rows["trn1.2xlarge"], rows["inf2.xlarge"]
    # trn1.2xlarge $1.34375/h: 1000/s * 3600 s = 3.6e6 samples per hour
    assert float(trn1["samples_per_dollar"]) == pytest.approx(2_679_069.77, rel=1e-6)
    assert float(trn1["usd_per_million_samples"]) == pytest.approx(0.373264, rel=1e-5)
    assert float(trn1["usd_per_epoch"]) == pytest.approx(0.000558776, rel=1e-5)  # 1497 samples
    # inf2.xlarge $0.7582/h: 800/s * 3600 = 2.88e6 samples per hour
    assert float(inf2["samples_per_dollar"]) == pytest.approx(3_798_470.06, rel=1e-6)
    assert float(inf2["usd_per_million_samples"]) == pytest.approx(0.263264, rel=1e-5)
    assert float(inf2["relative_to_baseline"]) == pytest.approx(1.417832, rel=1e-5)
    assert float(trn1["relative_to_baseline"]) == 1.0
    assert trn1["baseline_instance"] == "trn1.2xlarge"  # the reference study's baseline by default
    assert trn1["price_source"].startswith("AWS on-demand price list")
    assert trn1["price_date"] == "2026-07-20" and trn1["price_region"] == "us-east-1"
    assert "CPU" in trn1["device"] and trn1["provenance"].startswith("measured here: trn1.json")


def test_baseline_flag_and_epoch_samples(tmp_path):
    a = result(tmp_path, "trn1.json", instance="trn1.2xlarge", sps=1000.0)
    b = result(tmp_path, "inf2.json", instance="inf2.xlarge", sps=800.0)
    out = tmp_path / "rep"
    assert run_report(a, b, "--baseline", "inf2.xlarge", "--epoch-samples", "1281167", "--out", out) == 0
    rows = {r["instance_type"]: r for r in read_csv(out)}
    assert float(rows["trn1.2xlarge"]["relative_to_baseline"]) == pytest.approx(0.705302, rel=1e-5)
    # ImageNet-1k epoch on inf2.xlarge: 1281167 / 800 s = 1601.46 s = 0.444849 h x $0.7582
    assert float(rows["inf2.xlarge"]["usd_per_epoch"]) == pytest.approx(0.337285, rel=1e-5)


def test_unknown_baseline_is_refused(tmp_path, capsys):
    a = result(tmp_path, "trn1.json", instance="trn1.2xlarge", sps=1000.0)
    assert run_report(a, "--baseline", "p4d.24xlarge", "--out", tmp_path / "rep") == 2
    assert "--baseline p4d.24xlarge: no priced row" in capsys.readouterr().err


def test_inf1_training_appears_as_unsupported(tmp_path):
    train = result(tmp_path, "trn1-train.json", TRAIN, instance="trn1.2xlarge", sps=200.0)
    infer = result(tmp_path, "inf1-infer.json", instance="inf1.xlarge", sps=900.0)
    claimed = result(tmp_path, "inf1-train.json", TRAIN, instance="inf1.2xlarge", sps=300.0)
    out = tmp_path / "rep"
    assert run_report(train, infer, claimed, "--out", out) == 0
    rows = read_csv(out)
    train_rows = {r["instance_type"]: r for r in rows if r["mode"] == "train"}
    for itype in ("inf1.xlarge", "inf1.2xlarge"):
        assert train_rows[itype]["origin"] == "unsupported"
        assert "inference-only" in train_rows[itype]["note"]
        assert train_rows[itype]["samples_per_sec"] == ""   # a claimed figure is not used
    assert "not used" in train_rows["inf1.2xlarge"]["note"]
    infer_rows = [r for r in rows if r["mode"] == "infer"]
    assert [r["origin"] for r in infer_rows] == ["measured"]  # inf1 infers fine
    md = (out / "report.md").read_text()
    assert "not supported" in md and "inference-only" in md


@pytest.mark.parametrize("content, expected", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a bench result"),
    (json.dumps({**INFER, "schema_version": 99}), "schema_version 99 is not supported"),
    (json.dumps({k: v for k, v in INFER.items() if k != "compile"}), "missing field 'compile.time_s'"),
    (json.dumps({**INFER, "world_size": "1"}), "field 'world_size' must be an integer >= 1, got '1'"),
    (json.dumps({**INFER, "mode": "serve"}), "mode must be one of train, infer"),
    (json.dumps({**INFER, "global_batch_size": 33}), "not a multiple of batch_size_per_device"),
])
def test_malformed_result_is_rejected_in_one_line(tmp_path, capsys, content, expected):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert run_report(bad, "--out", tmp_path / "rep") == 2
    err = capsys.readouterr().err
    assert expected in err and str(bad) in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "rep").exists()


def test_mismatched_workloads_are_rejected(tmp_path, capsys):
    """One model measured at two image sizes is refused (another model is a group of its own:
    test_byos_corpus.py renders a script's result next to our loop's)."""
    a = result(tmp_path, "a.json", instance="trn1.2xlarge", sps=1000.0)
    other = copy.deepcopy(INFER)
    other["model"] = {**other["model"], "img_size": 64}
    b = result(tmp_path, "b.json", other, instance="inf2.xlarge", sps=800.0)
    assert run_report(a, b, "--out", tmp_path / "rep") == 2
    err = capsys.readouterr().err
    assert "b.json measures vit-digits at 64 px" in err and "a.json measures vit-digits at 32 px" in err
    assert "one workload per mode" in err


def test_existing_report_is_not_overwritten_without_force(tmp_path, capsys):
    a = result(tmp_path, "a.json", instance="trn1.2xlarge", sps=1000.0)
    out = tmp_path / "rep"
    out.mkdir()
    (out / "report.md").write_text("my notes")
    assert run_report(a, "--out", out) == 2
    assert "already holds a report" in capsys.readouterr().err
    assert (out / "report.md").read_text() == "my notes"
    assert run_report(a, "--out", out, "--force") == 0
    assert (out / "report.md").read_text().startswith("# Price-performance report")


def test_html_is_self_contained_and_pngs_render(tmp_path):
    from matplotlib.image import imread

    a = result(tmp_path, "trn1.json", instance="trn1.2xlarge", sps=1000.0)
    sweep = [{"batch_size_per_device": 32, "world_size": 1, "status": "ok", "reason": "",
              "samples_per_sec": 150.0, "step_time_ms": 213.0, "compile_time_s": 3.0, "graph_count": 1},
             {"batch_size_per_device": 64, "world_size": 1, "status": "oom",
              "reason": "RuntimeError: Out of memory allocating 2199023255552 bytes."}]
    b = result(tmp_path, "local.json", instance="local", sps=150.0, sweep=sweep)
    out = tmp_path / "rep"
    assert run_report(a, b, "--reference", FIX / "inf2_throughput_data_vision_transformers.csv",
                      "--reference-model", "google/vit-base", "--out", out) == 0
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3
    assert "src='http" not in page and 'src="http' not in page and "<link" not in page
    assert "not of Neuron hardware" in page                      # CPU rows are labelled
    assert "imported: inf2_throughput_data_vision_transformers.csv" in page
    for name in ("throughput.png", "price_performance.png", "cost.png"):
        image = imread(out / name)
        assert image.shape[0] > 400 and image.shape[1] > 800
    md = (out / "report.md").read_text()
    assert "| 64 | 1 | oom | n/a | RuntimeError: Out of memory allocating" in md  # the sweep's record
    assert md.count("no price") == 1  # local: not in the catalog, no --prices file
    assert "| local | measured here: local.json (" in md
    assert "| trn1.2xlarge (baseline) | measured here: trn1.json" in md
    assert "$1.34 on-demand, us-east-1, 2026-07-20" in md


def test_reference_tables_import_with_their_own_columns():
    vit = read_reference_csv(FIX / "inf2_throughput_data_vision_transformers.csv", ["google/vit-base"])
    assert len(vit) == 1
    row = vit[0]
    assert (row.instance_type, row.mode, row.img_size, row.batch_size) == ("inf2.xlarge", "infer", 224, 2)
    assert row.samples_per_sec == 1955.406 and row.neuron_version == "2.21.0"
    assert row.precision == "FP32 (autocast Matmult-BF16)" and row.latency_p50_ms == 4.087
    train = read_reference_csv(FIX / "trn1_training_data_vision_transformers.csv")
    assert (train[0].instance_type, train[0].mode, train[0].world_size) == ("trn1.32xlarge", "train", 32)
    assert train[0].instance_note == "also trn1n.32xlarge" and train[0].samples_per_sec == 6587.25
    inf1 = read_reference_csv(FIX / "inf1_throughput_data_cnn.csv", ["Resnet-50"])
    assert {r.instance_type for r in inf1} == {"inf1.xlarge"} and inf1[0].samples_per_sec == 921.5


def test_multi_node_reference_is_priced_per_instance(tmp_path):
    out = tmp_path / "rep"
    assert run_report("--reference", FIX / "trn1_training_data_encoder.csv", "--out", out) == 0
    rows = [r for r in read_csv(out) if r["instances"] == "16"]
    assert len(rows) == 2
    amp = next(r for r in rows if r["precision"].startswith("Autocast"))
    assert float(amp["usd_per_hour"]) == pytest.approx(344.0)  # 16 x $21.50
    # 57407.9207 seq/s = 206,668,514.5 per hour for $344
    assert float(amp["usd_per_million_samples"]) == pytest.approx(1.664502, rel=1e-5)
    assert amp["world_size"] == "512" and amp["unit"] == "sequences"


def test_one_model_from_two_tables_is_compared_across_instances(tmp_path):
    """inf1's "Resnet-50" and inf2's "resnet50" are one workload; the cheapest type is the baseline."""
    out = tmp_path / "rep"
    assert run_report("--reference", FIX / "inf1_throughput_data_cnn.csv",
                      "--reference", FIX / "inf2_throughput_data_vision_cnn.csv",
                      "--reference-model", "resnet-50", "--reference-model", "resnet50", "--out", out) == 0
    rows = read_csv(out)
    assert {r["workload"] for r in rows} == {"Inference · Resnet-50"}
    inf2 = next(r for r in rows if r["instance_type"] == "inf2.xlarge")
    # 4393.304/s x 3600 / $0.7582 = 20,859,792 images per dollar
    assert float(inf2["samples_per_dollar"]) == pytest.approx(20_859_792.1, rel=1e-6)
    # baseline: inf1.xlarge ($0.228/h), its best row (TensorFlow fp16, 2207/s): 34,847,368 per $
    assert inf2["baseline_instance"] == "inf1.xlarge"
    assert float(inf2["relative_to_baseline"]) == pytest.approx(0.598605, rel=1e-5)
    pt = next(r for r in rows if r["instance_type"] == "inf1.xlarge" and r["precision"] == "fp32")
    assert float(pt["samples_per_dollar"]) == pytest.approx(14_550_000.0)  # 921.5 x 3600 / 0.228
    assert pt["framework"] == "PyTorch 1.13"


def test_token_tables_and_unknown_csvs_are_refused(tmp_path):
    with pytest.raises(UsageError, match="token-throughput table"):
        read_reference_csv(FIX / "inf2_throughput_data_decoder_head.csv")
    other = tmp_path / "x.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(UsageError, match="not a Neuron SDK performance table"):
        read_reference_csv(other)


def test_price_file_overrides_and_extends_the_catalog(tmp_path):
    yml = tmp_path / "prices.yaml"
    yml.write_text("prices:\n"
                   "  - {instance_type: trn1.2xlarge, usd_per_hour: 1.0, region: us-west-2,\n"
                   "     date: '2026-09-01', source: my EDP contract}\n"
                   "  - {instance_type: local, usd_per_hour: 0.10264, region: us-east-1,\n"
                   "     date: '2026-07-20', source: c7a.large on-demand (assumption)}\n")
    cat = apply_price_file(load_catalog(), yml)
    assert cat.price("trn1.2xlarge").usd_per_hour == 1.0
    assert cat.price("trn1.2xlarge").source == "my EDP contract"
    assert cat.price("local").usd_per_hour == 0.10264
    assert cat.price("inf2.xlarge").usd_per_hour == 0.7582  # untouched
    rows = tmp_path / "prices.csv"
    rows.write_text("instance_type,usd_per_hour,region,date,source\n"
                    "inf2.xlarge,0.5,us-east-1,2026-09-01,quote\n")
    assert apply_price_file(load_catalog(), rows).price("inf2.xlarge").usd_per_hour == 0.5
    bad = tmp_path / "bad.yaml"
    bad.write_text("prices:\n  - {instance_type: local, usd_per_hour: 0.1, region: us-east-1}\n")
    with pytest.raises(UsageError, match="lacks date, source"):
        apply_price_file(load_catalog(), bad)
    typo = tmp_path / "typo.json"
    typo.write_text('{"instances": {"inf1.xlarge": {"host_memory_gib": "eight"}}}')
    with pytest.raises(UsageError, match="host_memory_gib must be a number"):
        apply_price_file(load_catalog(), typo)


def test_catalog_covers_the_issue_types_with_sourced_prices():
    cat = load_catalog()
    wanted = ["trn1.2xlarge", "trn1.32xlarge", "trn1n.32xlarge", "inf2.xlarge", "inf2.8xlarge",
              "inf2.24xlarge", "inf2.48xlarge", "inf1.xlarge", "inf1.2xlarge", "inf1.6xlarge",
              "inf1.24xlarge", "g5.xlarge", "p4d.24xlarge"]
    for name in wanted:
        spec = cat.get(name)
        assert spec is not None and spec.price is not None, name
        assert spec.price.region and spec.price.date and spec.price.source and spec.price.url
        assert spec.spec_source
        assert spec.can_train == (not name.startswith("inf1.")), name
    assert cat.get("trn1.32xlarge").cores == 32 and cat.get("inf2.48xlarge").accelerator_memory_gib == 384


def _stubbed_session(response: dict, region_location: str):
    session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                            region_name="us-east-1")
    client = session.client("pricing", region_name="us-east-1")
    stub = Stubber(client)
    filters = [{"Type": "TERM_MATCH", "Field": f, "Value": v} for f, v in [
        ("instanceType", "trn1.2xlarge"), ("location", region_location), ("operatingSystem", "Linux"),
        ("tenancy", "Shared"), ("preInstalledSw", "NA"), ("capacitystatus", "Used")]]
    stub.add_response("get_products", response,
                      {"ServiceCode": "AmazonEC2", "Filters": filters, "MaxResults": 10})
    stub.activate()
    session.client = lambda name, region_name=None: client  # hand our stubbed client to live_prices
    return session, stub


def test_live_prices_parse_the_price_list_response():
    response = json.loads((FIX / "pricing_get_products_trn1.2xlarge.json").read_text())
    session, stub = _stubbed_session(response, "US East (N. Virginia)")
    prices = live_prices(["trn1.2xlarge"], "us-east-1", session=session,
                         locations=load_catalog().pricing_locations)
    stub.assert_no_pending_responses()
    price = prices["trn1.2xlarge"]
    assert price.usd_per_hour == 1.34375 and price.kind == "on-demand" and price.region == "us-east-1"
    assert price.date == dt.datetime.now(dt.timezone.utc).date().isoformat()
    assert "live" in price.source and "2026-07-15" in price.source


def test_live_prices_without_credentials_say_so(tmp_path, capsys):
    with pytest.raises(RunError, match="no AWS credentials found"):
        live_prices(["trn1.2xlarge"], "us-east-1")
    a = result(tmp_path, "a.json", instance="trn1.2xlarge", sps=1000.0)
    assert run_report(a, "--prices", "live", "--out", tmp_path / "rep") == 1
    assert "no AWS credentials found" in capsys.readouterr().err


def test_live_spot_prices_take_the_cheapest_zone():
    """Three zones at three prices, the cheapest neither first nor last: only min() picks 0.2287."""
    session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                            region_name="us-west-2")
    client = session.client("ec2", region_name="us-west-2")
    now = dt.datetime.now(dt.timezone.utc)
    quotes = [("us-west-2a", "0.3152"), ("us-west-2b", "0.2287"), ("us-west-2c", "0.4019")]
    history = [{"AvailabilityZone": zone, "InstanceType": "inf2.xlarge", "ProductDescription": "Linux/UNIX",
                "SpotPrice": price, "Timestamp": now} for zone, price in quotes]
    sent = []
    client.meta.events.register("provide-client-params.ec2.DescribeSpotPriceHistory",
                                lambda params, **_: sent.append(dict(params)))
    stub = Stubber(client)
    stub.add_response("describe_spot_price_history", {"SpotPriceHistory": history},
                      {"InstanceTypes": ["inf2.xlarge"], "ProductDescriptions": ["Linux/UNIX"],
                       "StartTime": ANY})
    stub.activate()
    regions = []
    session.client = lambda name, region_name=None: regions.append((name, region_name)) or client
    prices = live_prices(["inf2.xlarge"], "us-west-2", spot=True, session=session)
    stub.assert_no_pending_responses()
    assert regions == [("ec2", "us-west-2")]
    # StartTime "now": AWS then returns each zone's current price, not a day of history.
    (request,) = sent
    assert abs((request["StartTime"] - now).total_seconds()) < 60
    price = prices["inf2.xlarge"]
    assert (price.usd_per_hour, price.kind, price.region) == (0.2287, "spot", "us-west-2")


def test_money_is_readable_at_every_scale():
    from neuron_train.cost.catalog import money

    assert [money(v) for v in (344.0, 1.34375, 0.9066, 0.0287, 8.538e-06, None)] == [
        "$344.00", "$1.34", "$0.9066", "$0.02870", "$0.000008538", "n/a"]
