"""Guards of the compile cache's paths that each killed a mutant which survived the rest of the suite
(issue 22; docs/measurements.md lists the mutant, the break and the test): `..` in a manifest key
(precompile/manifest.py) and in an archive member (precompile/archive.py). Pure and fast; each fails
with its guard removed.
"""

from __future__ import annotations

import io
import tarfile

import pytest

from neuron_train.common.errors import RunError
from neuron_train.precompile import archive, store
from neuron_train.precompile.manifest import GraphRecord, Manifest, ManifestError, is_cache_file_path
from tests.precompile.test_cache import CONFIG, add_config, xla_entry

# ----- `..` in manifest keys (M09) and archive members (M10) ----------------------------------------
NEURON_MODULE = "neuronxcc-2.0.0.22266a0+a69f71e55/MODULE_9219523464496887986+abb26765"


@pytest.mark.parametrize("key", ["xla/..", f"{NEURON_MODULE}/../../../x", f"{NEURON_MODULE}/sub/../x"])
def test_a_manifest_key_with_dot_dot_is_refused_even_when_its_shape_fits(key):
    """Each has the shape of a cache file (`xla/NAME`, `neuronxcc-*/MODULE_*/FILE...`): only the
    `..` check refuses it."""
    assert not is_cache_file_path(key)
    raw = {"format": "neuron-train-graph-manifest", "version": 1, "configs": {},
           "files": {key: {"sha256": "0" * 64, "size": 1, "recorded": "2026-11-01T00:00:00Z", "recorded_by": "fp"}}}
    with pytest.raises(ManifestError, match="not a file of a compile cache"):
        Manifest.from_json(raw, "m.json")


def _packed(tmp_path):
    cache = tmp_path / "cache"
    xla_entry(cache, "67939951107342009493273238831484768838")
    add_config(cache, "aaaaaaaaaaaaaaaa", CONFIG, {"h1": GraphRecord(phase="train", step=0)})
    good = tmp_path / "good.tar.gz"
    archive.pack(cache, str(good))
    return good


@pytest.mark.parametrize("name", ["xla/../../escaped", "xla/../escaped"])
def test_an_archive_member_with_dot_dot_is_refused_before_anything_is_extracted(tmp_path, name):
    """M10. A packed archive plus one member whose name climbs out: refused by name, in one line, and
    the destination cache gets nothing."""
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(_packed(tmp_path)) as src, tarfile.open(bad, "w:gz") as dst:
        for m in src.getmembers():
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
        evil = tarfile.TarInfo(name)
        evil.size = 4
        dst.addfile(evil, io.BytesIO(b"evil"))
    dest = tmp_path / "dst" / "cache"
    with pytest.raises(RunError, match=r"is not a plain relative file: refusing to unpack"):
        archive.unpack(str(bad), dest)
    assert not list(tmp_path.rglob("escaped"))
    assert not (dest / store.MANIFEST).exists() and not (dest / store.XLA_DIR).exists()
