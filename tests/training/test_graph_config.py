"""Which settings change a run's graphs is declared on the fields (training/config.py, `graph=`):
the manifest's configuration and the coverage messages follow from that one declaration."""

from __future__ import annotations

import dataclasses

import pytest

from neuron_train.precompile.coverage import differences, fingerprint
from neuron_train.training.cache_hook import RUNTIME_LABELS, config_labels, graph_config
from neuron_train.training.config import RunConfig, sections
from neuron_train.training.config_io import build_config


def config(overrides: dict | None = None) -> dict:
    return graph_config(build_config(overrides or {}), world_size=2, num_classes=10, device="CPU",
                        env={"NEURON_CC_FLAGS": "-O1"}, versions={"torch": "2.9.0"})


# Fingerprints the previous code (the LABELS/graph_config list in precompile/coverage.py, commit
# 644c370) gave these configurations: caches precompiled before the declaration moved still match.
@pytest.mark.parametrize("overrides, fp", [
    ({}, "c938f9a8cb60b0c4"),
    ({"sift": {"sift": "topk", "sift_keep": 0.25}}, "6bca1a37c6b54c3f"),
    ({"sift": {"sift": "relative"}}, "7ca81fd793383e0c"),
    ({"optim": {"grad_clip": 0.0, "zero1": True}}, "9088dc1711e1a713"),
    ({"model": {"name": "vit-nano", "img_size": 64}, "train": {"batch_size": 16, "precision": "bf16"}},
     "915715e8047b38f3"),
])
def test_fingerprints_of_existing_manifests_are_unchanged(overrides, fp):
    assert fingerprint(config(overrides)) == fp


def recorded_by_default() -> list[tuple[str, str]]:
    """(section, manifest key) of each field marked graph=, but those a default configuration leaves
    out (absent_when_off: added after manifests existed)."""
    cfg = RunConfig()
    return [(s, f.metadata["graph"].key or f.name) for s in sections(cfg) for f in dataclasses.fields(getattr(cfg, s))
            if f.metadata["graph"] and not f.metadata["graph"].absent_when_off]


def test_the_configuration_holds_exactly_the_marked_fields_and_the_compile_environment():
    keys = set(config())
    marked = {key for _, key in recorded_by_default()}
    assert keys == marked | set(RUNTIME_LABELS) | {"device", "neuron_cc_flags", "versions"}
    recipe = set(config({"recipe": {"cutmix": 1.0, "model_ema": True}}))
    assert recipe - keys == {"soft_targets", "model_ema"}  # recorded once in play
    assert {"lr", "momentum", "weight_decay", "distill_alpha", "seed"}.isdisjoint(keys)  # data, not graph


def test_a_setting_changes_the_fingerprint_only_when_marked():
    base = fingerprint(config())
    assert fingerprint(config({"train": {"batch_size": 16}})) != base
    assert fingerprint(config({"model": {"drop_path": 0.1}})) != base
    assert fingerprint(config({"optim": {"lr": 0.5}})) == base   # the LR reaches the graph as data
    assert fingerprint(config({"sift": {"sift_keep": 0.25}})) == base  # not in play without --sift topk


def test_coverage_names_a_marked_setting_by_its_declared_label():
    here, there = config({"model": {"img_size": 64}, "optim": {"optimizer_impl": "for-loop"}}), config()
    assert differences(here, there, config_labels()) == [
        "image size 64 here, 32 in the manifest",
        "optimizer implementation for-loop here, foreach in the manifest"]
    assert differences(config({}), {**config({}), "world_size": 1}, config_labels()) == [
        "world size 2 here, 1 in the manifest"]
