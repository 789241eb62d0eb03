"""Models: any timm model by name, small ViT presets that fit a CPU, and local weight loading.

Nothing here downloads: `pretrained` weights come only from a local file.
"""

from __future__ import annotations

from pathlib import Path

import torch

from neuron_train.common.errors import UsageError
from neuron_train.training.checkpoint import checked_file, read
from neuron_train.training.checkpoint_format import describe_mismatch, origin

# Small ViTs that train in minutes on a CPU; on Neuron use full timm names (vit_base_patch16_224).
PRESETS: dict[str, dict] = {
    "vit-digits": dict(model="vit_tiny_patch16_224", patch_size=8, embed_dim=96, depth=4, num_heads=3),
    "vit-digits-teacher": dict(model="vit_tiny_patch16_224", patch_size=4, embed_dim=192, depth=6,
                               num_heads=3),
    # One block: compiles in a few seconds, for smoke tests and trying out options, not for accuracy.
    "vit-nano": dict(model="vit_tiny_patch16_224", patch_size=8, embed_dim=32, depth=1, num_heads=2),
    "vit-micro": dict(model="vit_tiny_patch16_224", patch_size=8, embed_dim=192, depth=4, num_heads=3),
}


def check_model_name(name: str) -> str:
    """The timm model behind `name` (a preset or a timm name); an unknown name is one line.

    Cheap (no model is built): the training command calls it before torch_xla starts."""
    import timm

    timm_name = PRESETS.get(name, {"model": name})["model"]
    if not timm.is_model(timm_name):
        raise UsageError(f"unknown model '{name}': not a preset ({', '.join(PRESETS)}) nor a timm "
                         "model (see timm.list_models())")
    return timm_name


def create_model(name: str, *, num_classes: int, img_size: int, drop_path: float = 0.0) -> torch.nn.Module:
    """Build `name` (a preset or any timm model) with random weights."""
    import timm

    kwargs = dict(PRESETS.get(name, {"model": name}))
    kwargs.pop("model")
    timm_name = check_model_name(name)
    kwargs.update(num_classes=num_classes, drop_path_rate=drop_path)
    try:
        return timm.create_model(timm_name, pretrained=False, img_size=img_size, **kwargs)
    except TypeError as exc:
        if "img_size" not in str(exc):
            raise UsageError(f"model '{name}': {exc}") from None
    # Convolutional nets take any input size and have no img_size argument.
    return timm.create_model(timm_name, pretrained=False, **kwargs)


def _weights_file(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """A file's state dict and where it is from: our checkpoint, a plain state dict, or safetensors."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        damage = checked_file(path, "cannot read weights from")  # its .sha256 too, as for every file
        if damage:
            raise UsageError(f"cannot read weights from {path}: {damage}")

        try:
            return load_file(str(path)), "a safetensors file"
        except Exception as exc:  # any unreadable file is the user's input problem, said in one line
            raise UsageError(f"cannot read weights from {path}: not a complete safetensors file "
                             f"({str(exc).splitlines()[0]})") from None
    obj = read(path, "cannot read weights from")
    where = origin(obj)
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]                      # one of our checkpoints
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UsageError(f"{path} is not a checkpoint or state dict: it holds no mapping of names "
                         "to tensors")
    return obj, where


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Model weights from a file: our checkpoint, a plain state dict, or safetensors."""
    return _weights_file(Path(path))[0]


def load_weights(model: torch.nn.Module, path: str | Path) -> tuple[list[str], str]:
    """Load matching weights; return the model's names left at random init (e.g. a new head) and
    where the file is from."""
    state, where = _weights_file(Path(path))
    own = model.state_dict()
    usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not usable:
        raise UsageError(f"{path}: no weight matches this model's parameters ({describe_mismatch(state, own)}); "
                         f"the file is from {where}")
    model.load_state_dict(usable, strict=False)
    return [k for k in own if k not in usable], where


def build_model(name: str, *, num_classes: int, img_size: int, drop_path: float = 0.0,
                pretrained: str | None = None) -> torch.nn.Module:
    model = create_model(name, num_classes=num_classes, img_size=img_size, drop_path=drop_path)
    if pretrained:
        skipped, where = load_weights(model, pretrained)
        if skipped:
            print(f"note: {pretrained} ({where}): {len(skipped)} of this model's {len(model.state_dict())} "
                  f"weights are not in the file or of another shape, left at random init: "
                  f"{', '.join(skipped[:4])}{', ...' if len(skipped) > 4 else ''}")
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
