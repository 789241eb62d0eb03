"""A stand-in workload of a published Neuron row's model, for `scripts/validate_plan.py`: the model
is built from its transformers / timm configuration with random weights (nothing is downloaded)
and runs a few steps on the XLA device with one `torch_xla.sync()` per step, as the published
benchmarks do: a forward without gradients (--mode infer) or forward, backward and an AdamW update
(--mode train). It is what `neuron-train plan -- python scripts/plan_standin.py ...` measures.

    python scripts/plan_standin.py --model bert-base --mode infer --batch 16 --seq 128 [--steps 8]
"""

from __future__ import annotations

import argparse

import torch
import torch_xla

# model name -> (library, class or timm name, configuration); sizes as the published checkpoints'
ENCODERS = {
    "bert-base": ("BertConfig", "BertModel", {}),
    "bert-large": ("BertConfig", "BertModel", dict(hidden_size=1024, num_hidden_layers=24,
                                                   num_attention_heads=16, intermediate_size=4096)),
    "distilbert": ("DistilBertConfig", "DistilBertModel", {}),
    "roberta-base": ("RobertaConfig", "RobertaModel", {}),
    "albert-base": ("AlbertConfig", "AlbertModel", dict(embedding_size=128, hidden_size=768, num_attention_heads=12,
                                                        intermediate_size=3072)),
    "bert-large-pretraining": ("BertConfig", "BertForPreTraining", dict(hidden_size=1024, num_hidden_layers=24,
                                                                        num_attention_heads=16, intermediate_size=4096)),
    "vit-base-hf": ("ViTConfig", "ViTForImageClassification", {}),
}
TIMM = {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "vgg11", "vgg16"}


def build(name: str) -> torch.nn.Module:
    if name in TIMM:
        import timm
        return timm.create_model(name, pretrained=False)
    import transformers
    config_cls, model_cls, sizes = ENCODERS[name]
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**sizes))


def batch(name: str, size: int, seq: int) -> torch.Tensor:
    if name in TIMM or name.startswith("vit"):
        return torch.randn(size, 3, 224, 224)
    return torch.randint(0, 1000, (size, seq))


def output_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted([*ENCODERS, *TIMM]))
    parser.add_argument("--mode", choices=("infer", "train"), default="infer")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch_xla.device()
    model = build(args.model).to(device)
    model.train(args.mode == "train")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5) if args.mode == "train" else None
    host_batch = batch(args.model, args.batch, args.seq)
    for _ in range(args.steps):
        x = host_batch.to(device)
        if optimizer is None:
            with torch.no_grad():
                y = output_tensor(model(x))
        else:
            loss = output_tensor(model(x)).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # Sync point: one step is one graph, as the published benchmarks' loops run it.
        torch_xla.sync()
    if optimizer is None:
        y.cpu()


if __name__ == "__main__":
    main()
