"""Instance catalog and prices: the shipped data file, a user's price file, or live AWS prices.

The catalog is data (`neuron_train/data/instances.yaml`), not code: hardware of each instance type,
whether it can train, and an on-demand price that always carries its region, date and source.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import io
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from neuron_train.common import reader
from neuron_train.common.errors import RunError, UsageError
from neuron_train.common.values import out_of_range, range_problem, shown

CATALOG_PATH = Path(__file__).resolve().parent.parent / "data" / "instances.yaml"
PRICES_LIMIT = 4 * 2**20  # a price file is a few KiB
PRICE_COLUMNS = ("instance_type", "usd_per_hour", "region", "date", "source")


@dataclass(frozen=True)
class Price:
    usd_per_hour: float
    region: str
    date: str            # when the price was read (YYYY-MM-DD)
    source: str          # where it was read, short and readable by a person
    url: str = ""
    kind: str = "on-demand"

    def label(self) -> str:
        return f"${self.usd_per_hour:g}/h {self.kind}, {self.region}, {self.date}, {self.source}"


@dataclass(frozen=True)
class InstanceType:
    name: str
    accelerator: str
    accelerators: int
    cores: int
    core_kind: str
    accelerator_memory_gib: float
    vcpus: int
    host_memory_gib: float
    can_train: bool
    spec_source: str
    train_note: str = ""       # why it cannot train, when can_train is false
    price: Price | None = None


@dataclass
class Catalog:
    instances: dict[str, InstanceType]
    sources: dict[str, dict[str, str]] = field(default_factory=dict)
    pricing_locations: dict[str, str] = field(default_factory=dict)
    # Prices for types without a catalog entry (e.g. `local`, priced by the user).
    extra_prices: dict[str, Price] = field(default_factory=dict)

    def get(self, name: str) -> InstanceType | None:
        return self.instances.get(name.lower())

    def price(self, name: str) -> Price | None:
        spec = self.get(name)
        return spec.price if spec and spec.price else self.extra_prices.get(name.lower())

    def with_prices(self, prices: dict[str, Price]) -> Catalog:
        """A copy with `prices` replacing the catalog's (types outside the catalog are kept apart)."""
        instances = dict(self.instances)
        extra = dict(self.extra_prices)
        for name, price in prices.items():
            name = name.lower()
            if name in instances:
                instances[name] = dataclasses.replace(instances[name], price=price)
            else:
                extra[name] = price
        return Catalog(instances, self.sources, self.pricing_locations, extra)


def _source(ref: str, sources: dict[str, dict[str, str]]) -> tuple[str, str]:
    """(short name, url) of a source key; free text stands for itself."""
    src = sources.get(ref)
    if not isinstance(src, dict):
        return ref, ""
    return str(src.get("short") or src.get("title") or ref), str(src.get("url", ""))


def _parse_price(raw: Any, where: str, sources: dict[str, dict[str, str]]) -> Price:
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: price must be a mapping with usd_per_hour, region, date, source")
    missing = [k for k in PRICE_COLUMNS[1:] if raw.get(k) in (None, "")]
    if missing:
        raise UsageError(f"{where}: price lacks {', '.join(missing)} (every price names its region, "
                         "date and source)")
    try:
        usd = float(raw["usd_per_hour"])
    except (TypeError, ValueError, OverflowError):  # OverflowError: an integer beyond any float
        raise UsageError(f"{where}: usd_per_hour must be a number, got {shown(raw['usd_per_hour'])}") from None
    if not math.isfinite(usd) or usd <= 0:
        raise UsageError(f"{where}: usd_per_hour must be a finite number > 0, got {shown(raw['usd_per_hour'])}")
    if out_of_range(usd):  # a CSV price is parsed here, not by the reader
        raise UsageError(f"{where}: usd_per_hour: {range_problem(usd)}")
    name, url = _source(str(raw["source"]), sources)
    return Price(usd, str(raw["region"]), str(raw["date"]), name, str(raw.get("url") or url),
                 str(raw.get("kind", "on-demand")))


_SPEC_FIELDS = {f.name for f in dataclasses.fields(InstanceType)} - {"name", "price", "train_note"}
_SPEC_TYPES: dict[str, type | tuple] = {"accelerators": int, "cores": int, "vcpus": int,
                                        "accelerator_memory_gib": (int, float),
                                        "host_memory_gib": (int, float), "can_train": bool}


def _parse_instance(name: str, raw: Any, where: str, sources: dict[str, dict[str, str]],
                    base: InstanceType | None) -> InstanceType:
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: instance '{name}' must be a mapping")
    unknown = set(raw) - _SPEC_FIELDS - {"price", "train_note"}
    if unknown:
        raise UsageError(f"{where}: instance '{name}': unknown field(s) {', '.join(sorted(unknown))}")
    values = dataclasses.asdict(base) if base else {}
    values.pop("price", None)
    values.update({k: v for k, v in raw.items() if k != "price"})
    missing = sorted(_SPEC_FIELDS - set(values))
    if missing:
        raise UsageError(f"{where}: new instance '{name}' lacks {', '.join(missing)}")
    for key, kind in _SPEC_TYPES.items():
        value = values[key]
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            expected = "a number" if isinstance(kind, tuple) else kind.__name__
            raise UsageError(f"{where}: instance '{name}': {key} must be {expected}, got {value!r}")
    values["name"] = name
    name_, url = _source(str(values["spec_source"]), sources)
    values["spec_source"] = f"{name_} <{url}>" if url else name_
    price = _parse_price(raw["price"], f"{where}: {name}", sources) if "price" in raw else (
        base.price if base else None)
    try:
        return InstanceType(**{**values, "price": price})
    except TypeError as exc:
        raise UsageError(f"{where}: instance '{name}': {exc}") from None


def read_mapping(path: Path, ours: bool = False) -> dict:
    """A YAML/JSON price or catalog file as a mapping. A user's file goes through the bounded
    reader (no YAML aliases, bounded size, depth and numbers); `ours`, the shipped catalog, may use
    aliases (it does, for shared notes)."""
    if ours:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    else:
        data = reader.load(path, "--prices", fmt="json" if path.suffix == ".json" else "yaml", limit=PRICES_LIMIT)
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping with 'instances:' and/or 'prices:'")
    return data


def load_catalog(path: str | Path | None = None) -> Catalog:
    """The shipped catalog (CATALOG_PATH, read when called), or another file in the same format."""
    path = Path(path or CATALOG_PATH)
    data = read_mapping(path, ours=True)
    sources = data.get("sources") or {}
    instances = {name.lower(): _parse_instance(name.lower(), raw, str(path), sources, None)
                 for name, raw in (data.get("instances") or {}).items()}
    return Catalog(instances, sources, data.get("pricing_locations") or {})


def _price_rows_from_csv(path: Path) -> list[dict[str, str]]:
    text = reader.read_text(path, "--prices", limit=PRICES_LIMIT)
    try:
        rows = csv.DictReader(io.StringIO(text, newline=""))
        missing = [c for c in PRICE_COLUMNS if c not in (rows.fieldnames or [])]
        if missing:
            raise UsageError(f"{path}: missing CSV column(s) {', '.join(missing)} "
                             f"(expected {','.join(PRICE_COLUMNS)})")
        return list(rows)
    except csv.Error as exc:
        raise UsageError(f"{path}: not a readable CSV file ({exc})") from None


_SECTIONS = {"sources": (dict, "a mapping of source names"), "instances": (dict, "a mapping of instance types"),
             "prices": (list, "a list of price entries")}


def _check_sections(data: dict, path: Path) -> None:
    """A price file's sections have the shapes `apply_price_file` reads (names are strings)."""
    unknown = set(data) - set(_SECTIONS)
    if unknown:
        raise UsageError(f"{path}: unknown section(s) {', '.join(sorted(shown(k, 40) for k in unknown))} "
                         "(known: sources, instances, prices)")
    for key, (kind, text) in _SECTIONS.items():
        value = data.get(key)
        if value is not None and not isinstance(value, kind):
            raise UsageError(f"{path}: '{key}' must be {text}, got {shown(value)}")
        names: list[object] = [k for k in value if not isinstance(k, str)] if isinstance(value, dict) else []
        if names:
            raise UsageError(f"{path}: '{key}' has a name that is not text: {shown(names[0])}")


def apply_price_file(catalog: Catalog, path: str | Path) -> Catalog:
    """Override or extend the catalog with a user file (YAML/JSON `instances:`/`prices:`, or CSV)."""
    path = Path(path)
    reader.regular_file(path, "--prices")
    if path.suffix == ".csv":
        data: dict = {"prices": _price_rows_from_csv(path)}
    else:
        data = read_mapping(path)
        _check_sections(data, path)
    sources = {**catalog.sources, **(data.get("sources") or {})}
    instances = dict(catalog.instances)
    for name, raw in (data.get("instances") or {}).items():
        name = name.lower()
        instances[name] = _parse_instance(name, raw, str(path), sources, instances.get(name))
    merged = Catalog(instances, sources, catalog.pricing_locations, dict(catalog.extra_prices))
    prices: dict[str, Price] = {}
    for i, row in enumerate(data.get("prices") or [], 1):
        if not isinstance(row, dict) or not row.get("instance_type"):
            raise UsageError(f"{path}: price entry {i} needs instance_type")
        name = str(row["instance_type"])
        if name.lower() in {n.lower() for n in prices}:  # which one would win is a guess: refuse
            raise UsageError(f"{path}: price entry {i}: {name} is priced twice; keep one entry per instance type")
        prices[name] = _parse_price(row, f"{path}: price entry {i}", sources)
    return merged.with_prices(prices)


# --- live prices (AWS Price List API, EC2 spot price history) ------------------------------------

def _hourly_usd(price_item: dict) -> float | None:
    """The on-demand USD hourly rate in one Price List product document (aws_v1 format)."""
    for term in (price_item.get("terms", {}).get("OnDemand") or {}).values():
        for dim in (term.get("priceDimensions") or {}).values():
            usd = float(dim.get("pricePerUnit", {}).get("USD", 0) or 0)
            if dim.get("unit") == "Hrs" and usd > 0:
                return usd
    return None


def _pricing_filters(instance_type: str, region: str, locations: dict[str, str]) -> list[dict]:
    where = ({"Field": "location", "Value": locations[region]} if region in locations
             else {"Field": "regionCode", "Value": region})
    pairs = [("instanceType", instance_type), (where["Field"], where["Value"]),
             ("operatingSystem", "Linux"), ("tenancy", "Shared"), ("preInstalledSw", "NA"),
             ("capacitystatus", "Used")]
    return [{"Type": "TERM_MATCH", "Field": f, "Value": v} for f, v in pairs]


def _aws_call(what: str, call: Callable[..., dict[str, Any]]) -> dict[str, Any]:  # call(): a boto3 request
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return call()
    except (BotoCoreError, ClientError) as exc:
        raise RunError(f"--prices live: {what} failed: {str(exc).splitlines()[0]}") from None


def live_prices(instance_types: list[str], region: str, *, spot: bool = False, session: Any = None,
                locations: dict[str, str] | None = None) -> dict[str, Price]:
    """Current prices from AWS: on-demand via the Price List API, or the lowest spot price by zone.

    Types AWS does not price in `region` are left out: they keep their catalog price, whose label
    says where it came from. `session` is a boto3 Session (untyped: boto3 ships no types), a new one if None.
    """
    import boto3

    session = session or boto3.Session()
    if session.get_credentials() is None:
        raise RunError("--prices live: no AWS credentials found (environment, ~/.aws/credentials, "
                       "AWS_PROFILE or an instance role); configure them, or drop --prices live "
                       "to use the catalog prices")
    today = dt.datetime.now(dt.timezone.utc).date().isoformat()
    out: dict[str, Price] = {}
    if spot:
        ec2 = session.client("ec2", region_name=region)
        for itype in instance_types:
            resp = _aws_call("ec2:DescribeSpotPriceHistory", lambda t=itype: ec2.describe_spot_price_history(
                InstanceTypes=[t], ProductDescriptions=["Linux/UNIX"],
                StartTime=dt.datetime.now(dt.timezone.utc)))
            quotes = [float(h["SpotPrice"]) for h in resp.get("SpotPriceHistory", [])]
            if quotes:
                out[itype] = Price(min(quotes), region, today,
                                   "EC2 spot price history, lowest availability zone (live)", kind="spot")
        return out
    pricing = session.client("pricing", region_name="us-east-1")  # the API's home region
    for itype in instance_types:
        filters = _pricing_filters(itype, region, locations or {})
        resp = _aws_call("pricing:GetProducts", lambda f=filters: pricing.get_products(
            ServiceCode="AmazonEC2", Filters=f, MaxResults=10))
        for doc in resp.get("PriceList", []):
            item = json.loads(doc) if isinstance(doc, str) else doc
            usd = _hourly_usd(item)
            if usd:
                out[itype] = Price(usd, region, today, "AWS Price List API, live (published "
                                   f"{item.get('publicationDate', '?')[:10]})")
                break
    return out


def resolve_prices(catalog: Catalog, prices: str | None, instance_types: list[str], region: str,
                   spot: bool = False) -> Catalog:
    """Apply `--prices FILE|live` to the catalog."""
    if prices is None:
        if spot:
            raise UsageError("--spot needs --prices live (the catalog holds on-demand prices)")
        return catalog
    if prices == "live":
        known = [t for t in instance_types if t != "local"]
        return catalog.with_prices(live_prices(known, region, spot=spot,
                                               locations=catalog.pricing_locations))
    if spot:
        raise UsageError("--spot needs --prices live")
    return apply_price_file(catalog, prices)


def money(value: float | None, digits: int = 4) -> str:
    """Dollars for people: cents above $1, else `digits` significant digits, never 1e-05."""
    if value is None:
        return "n/a"
    if value >= 1 or value <= 0:
        return f"${value:,.2f}"
    return f"${value:.{digits - 1 - math.floor(math.log10(value))}f}"
