"""Models: any timm model by name, small ViT presets that fit a CPU, and local weight loading.

Nothing here downloads: `pretrained` weights come only from a local file.
"""

from __future__ import annotations

from pathlib import Path

import torch

from neuron_train.common.errors import UsageError

# Small ViTs that train in minutes on a CPU; on Neuron use full timm names (vit_base_patch16_224).
PRESETS: dict[str, dict] = {
    "vit-digits": dict(model="vit_tiny_patch16_224", patch_size=8, embed_dim=96, depth=4, num_heads=3),
    "vit-digits-teacher": dict(model="vit_tiny_patch16_224", patch_size=4, embed_dim=192, depth=6,
                               num_heads=3),
    # One block: compiles in a few seconds, for smoke tests and trying out options, not for accuracy.
    "vit-nano": dict(model="vit_tiny_patch16_224", patch_size=8, embed_dim=32, depth=1, num_heads=2),
    "vit-micro": dict(model="vit_tiny_patch16_224", patch_size=8, embed_dim=192, depth=4, num_heads=3),
}


def create_model(name: str, *, num_classes: int, img_size: int, drop_path: float = 0.0) -> torch.nn.Module:
    """Build `name` (a preset or any timm model) with random weights."""
    import timm

    kwargs = dict(PRESETS.get(name, {"model": name}))
    timm_name = kwargs.pop("model")
    if not timm.is_model(timm_name):
        raise UsageError(f"unknown model '{name}': not a preset ({', '.join(PRESETS)}) nor a timm "
                         "model (see timm.list_models())")
    kwargs.update(num_classes=num_classes, drop_path_rate=drop_path)
    try:
        return timm.create_model(timm_name, pretrained=False, img_size=img_size, **kwargs)
    except TypeError as exc:
        if "img_size" not in str(exc):
            raise UsageError(f"model '{name}': {exc}") from None
    # Convolutional nets take any input size and have no img_size argument.
    return timm.create_model(timm_name, pretrained=False, **kwargs)


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Model weights from a file: our checkpoint, a plain state dict, or safetensors."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unreadable file is the user's input problem, said in one line
        raise UsageError(f"cannot read weights from {path}: {str(exc).splitlines()[0]}") from None
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]                      # one of our checkpoints
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UsageError(f"{path} holds no state dict of tensors")
    return obj


def load_weights(model: torch.nn.Module, path: str | Path) -> list[str]:
    """Load matching weights; return the names skipped for a shape mismatch (e.g. a new head)."""
    state = read_state_dict(path)
    own = model.state_dict()
    skipped = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
    usable = {k: v for k, v in state.items() if k in own and k not in skipped}
    if not usable:
        raise UsageError(f"{path}: no weight matches the model's parameters")
    model.load_state_dict(usable, strict=False)
    return skipped


def build_model(name: str, *, num_classes: int, img_size: int, drop_path: float = 0.0,
                pretrained: str | None = None) -> torch.nn.Module:
    model = create_model(name, num_classes=num_classes, img_size=img_size, drop_path=drop_path)
    if pretrained:
        skipped = load_weights(model, pretrained)
        if skipped:
            print(f"note: {pretrained}: left at random init (shape differs): {', '.join(skipped)}")
    return model


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
