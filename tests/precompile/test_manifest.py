"""precompile/manifest.py in-process: the manifest read field by field, merged (unpack) and pruned.

Written to kill the mutants that survived a mutation run of the module (docs/measurements.md, "Scores"):
`merge` and `forget_entries` only ran inside `cache unpack` / `cache prune` subprocesses. What a
user relies on: unpacking never loses or replaces what the cache already records, pruning counts
what each configuration lost, and a manifest field of the wrong type is one line naming it, never
a traceback later.
"""

from __future__ import annotations

import pytest

from neuron_train.precompile.manifest import (
    ConfigRecord,
    FileRecord,
    GraphRecord,
    Manifest,
    ManifestError,
    is_cache_file_path,
)

SHA_A, SHA_B = "a" * 64, "b" * 64
WHERE = "/cache/manifest.json"


def config(graphs: dict, ids: list[str], updated: str, **more) -> ConfigRecord:
    return ConfigRecord(config={"model": "vit-nano"}, graphs=graphs, precompile_ids=ids, updated=updated, **more)


def file(sha: str, by: str) -> FileRecord:
    return FileRecord(sha256=sha, size=3, recorded="2026-11-01T00:00:00", recorded_by=by)


# ----- merge: what an unpack adds ---------------------------------------------------------------------


def test_merging_adds_what_is_new_and_keeps_what_the_cache_records():
    ours = Manifest(configs={"fp1": config({"g1": GraphRecord(phase="train", step=0)}, ["p2"], "2026-11-02")},
                    files={"xla/a": file(SHA_A, "fp1")})
    theirs = Manifest(configs={"fp1": config({"g1": GraphRecord(phase="eval", step=9), "g2": GraphRecord(step=1)},
                                             ["p1", "p2", "p3"], "2026-11-05"),
                               "fp2": config({"g3": GraphRecord()}, ["p9"], "2026-11-01")},
                      files={"xla/a": file(SHA_B, "unpack"), "xla/b": file(SHA_B, "fp2")})
    ours.merge(theirs)
    mine = ours.configs["fp1"]
    assert mine.graphs == {"g1": GraphRecord(phase="train", step=0), "g2": GraphRecord(step=1)}  # ours kept
    assert mine.precompile_ids == ["p1", "p2", "p3"]
    assert mine.updated == "2026-11-05"  # the later of the two
    assert ours.configs["fp2"].graphs == {"g3": GraphRecord()} and ours.configs["fp2"].precompile_ids == ["p9"]
    assert ours.files == {"xla/a": file(SHA_A, "fp1"), "xla/b": file(SHA_B, "fp2")}  # ours kept


def test_an_older_archive_never_moves_a_configuration_back_in_time():
    ours = Manifest(configs={"fp1": config({}, [], "2026-11-05")})
    ours.merge(Manifest(configs={"fp1": config({}, [], "2026-11-01")}))
    assert ours.configs["fp1"].updated == "2026-11-05"


def test_merging_never_changes_the_manifest_merged_from():
    """Two archives unpacked one after the other: the first one's records stay as they were read."""
    first = Manifest(configs={"fp1": config({"g1": GraphRecord()}, ["p1"], "2026-11-01")})
    second = Manifest(configs={"fp1": config({"g2": GraphRecord()}, ["p2"], "2026-11-02")})
    cache = Manifest()
    cache.merge(first)
    cache.merge(second)
    assert set(cache.configs["fp1"].graphs) == {"g1", "g2"} and cache.configs["fp1"].precompile_ids == ["p1", "p2"]
    assert set(first.configs["fp1"].graphs) == {"g1"} and first.configs["fp1"].precompile_ids == ["p1"]


# ----- forget_entries: what a prune or a quarantine removed ------------------------------------------------


def test_forgetting_entries_drops_their_files_and_counts_them_per_configuration():
    m = Manifest(configs={"fp1": config({}, [], "x", pruned_files=1), "fp2": config({}, [], "x")},
                 files={"neuronxcc-2.0/MODULE_1/model.neff": file(SHA_A, "fp1"),
                        "neuronxcc-2.0/MODULE_1/model.hlo": file(SHA_A, "fp1"),
                        "neuronxcc-2.0/MODULE_2/model.neff": file(SHA_A, "fp2"),
                        "xla/c": file(SHA_A, "fp2"), "xla/d": file(SHA_A, "gone-config")})
    m.forget_entries({"neuronxcc-2.0/MODULE_1", "xla/d"}, "2026-11-23T18:00:00")
    assert sorted(m.files) == ["neuronxcc-2.0/MODULE_2/model.neff", "xla/c"]
    assert (m.configs["fp1"].pruned_files, m.configs["fp1"].pruned_at) == (3, "2026-11-23T18:00:00")
    assert (m.configs["fp2"].pruned_files, m.configs["fp2"].pruned_at) == (0, None)


# ----- reading: every field checked, unknown ones kept ----------------------------------------------------


def manifest_json(**config_fields) -> dict:
    return {"format": "neuron-train-graph-manifest", "version": 1,
            "configs": {"fp1": {"config": {"model": "vit-nano"}, "graphs": {"g1": {"phase": "train", "step": 0}},
                                **config_fields}},
            "files": {"xla/a": {"sha256": SHA_A, "size": 3, "recorded": "t", "recorded_by": "fp1"}}}


def test_a_manifest_with_every_field_is_read_and_written_back_unchanged():
    data = manifest_json(precompile_ids=["p1"], created="2026-11-01", updated="2026-11-02", host="ip-10-0-0-1",
                         tour_steps=4, unidentified_graphs=0, pruned_files=2, pruned_at="2026-11-03",
                         a_later_field={"kept": True})
    data["configs"]["fp1"]["graphs"]["g1"].update(compile_time_s=1.5, note="kept too")
    m = Manifest.from_json(data, WHERE)
    record = m.configs["fp1"]
    assert (record.created, record.host, record.tour_steps, record.pruned_files) == ("2026-11-01", "ip-10-0-0-1", 4, 2)
    assert record.graphs["g1"] == GraphRecord(phase="train", step=0, compile_time_s=1.5, extra={"note": "kept too"})
    assert m.to_json() == data
    assert Manifest.from_json(m.to_json(), WHERE) == m


@pytest.mark.parametrize("field, value, problem", [
    ("precompile_ids", "p1", "precompile_ids must be"),
    ("created", 5, "created must be"),
    ("updated", None, "updated must be"),
    ("host", ["h"], "host must be"),
    ("tour_steps", -1, "tour_steps must be"),
    ("unidentified_graphs", "0", "unidentified_graphs must be"),
    ("pruned_files", 1.5, "pruned_files must be"),
    ("pruned_at", 3, "pruned_at must be"),
])
def test_a_configuration_field_of_the_wrong_type_is_one_line_naming_it(field, value, problem):
    with pytest.raises(ManifestError) as err:
        Manifest.from_json(manifest_json(**{field: value}), WHERE)
    assert str(err.value).startswith(f"{WHERE}: configs['fp1'].{problem}"), str(err.value)


@pytest.mark.parametrize("field, value", [("phase", 1), ("step", -1), ("compile_time_s", "fast")])
def test_a_graph_field_of_the_wrong_type_is_one_line_naming_it(field, value):
    data = manifest_json()
    data["configs"]["fp1"]["graphs"]["g1"][field] = value
    with pytest.raises(ManifestError) as err:
        Manifest.from_json(data, WHERE)
    assert str(err.value).startswith(f"{WHERE}: configs['fp1'].graphs['g1'].{field} must be"), str(err.value)


def test_a_section_that_is_null_says_null():
    data = manifest_json()
    data["configs"] = None
    with pytest.raises(ManifestError) as err:
        Manifest.from_json(data, WHERE)
    assert str(err.value) == f"{WHERE}: configs must be a JSON object, not null"


def test_top_level_fields_this_version_does_not_know_are_kept_and_only_they():
    data = manifest_json() | {"written_by": "a later neuron-train"}
    m = Manifest.from_json(data, WHERE)
    assert m.extra == {"written_by": "a later neuron-train"}
    written = m.to_json()
    assert sorted(written) == ["configs", "files", "format", "version", "written_by"]
    assert (written["format"], written["version"], written["written_by"]) == (
        "neuron-train-graph-manifest", 1, "a later neuron-train")


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("configs"), "the manifest has no 'configs' field"),
    (lambda d: d.pop("files"), "the manifest has no 'files' field"),
    (lambda d: d.update(files=None), "files must be a JSON object, not null"),
    (lambda d: d.update(files=[]), "files must be a JSON object, not list"),
    (lambda d: d["configs"].update(fp1=None), "configs['fp1'] must be a JSON object, not null"),
    (lambda d: d["configs"]["fp1"].pop("graphs"), "configs['fp1'] has no 'graphs' field"),
    (lambda d: d["configs"]["fp1"]["graphs"].update(g1=3),
     "configs['fp1'].graphs['g1'] must be a JSON object, not int"),
    (lambda d: d["files"]["xla/a"].update(size=-1), "files['xla/a'].size must be"),
    (lambda d: d["files"]["xla/a"].pop("recorded_by"), "files['xla/a'] has no 'recorded_by' field"),
    (lambda d: d["files"]["xla/a"].update(sha256="A" * 64), "files['xla/a'].sha256 is not a SHA-256"),
    (lambda d: d["files"].update({".": d["files"]["xla/a"]}), "files lists '.', which is not a file of a compile "
                                                               "cache (xla/NAME or neuronxcc-*/MODULE_*/FILE): it "
                                                               "may point outside the cache"),
])
def test_every_bad_part_is_one_line_naming_the_manifest_and_the_field(change, message):
    data = manifest_json()
    change(data)
    with pytest.raises(ManifestError) as err:
        Manifest.from_json(data, WHERE)
    assert str(err.value).startswith(f"{WHERE}: {message}"), str(err.value)


@pytest.mark.parametrize("rel", [".", "", None, 5, "xla/a\\b", "xla\\a", "xla/a\x00b", "xla/../x", "/xla/a",
                                 "xla//a", "xla/./a", "xla/a/b", "neuronxcc-2/x/y", "neuronxcc-2/MODULE_1"])
def test_what_is_not_a_cache_file_path_is_refused(rel):
    assert is_cache_file_path(rel) is False


def test_both_layouts_are_cache_file_paths():
    assert is_cache_file_path("xla/123") and is_cache_file_path("neuronxcc-2.0/MODULE_1+ab/sub/model.neff")
