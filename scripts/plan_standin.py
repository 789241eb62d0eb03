"""A stand-in workload of a published Neuron row's model, for `scripts/validate_plan.py`: the model
is built from its transformers / timm configuration with random weights (nothing is downloaded)
and runs a few steps on the XLA device with one `torch_xla.sync()` per step, as the published
benchmarks do: a forward without gradients (--mode infer) or forward, backward and an AdamW update
(--mode train). It is what `neuron-train plan -- python scripts/plan_standin.py ...` measures.

    python scripts/plan_standin.py --model bert-base --mode infer --batch 16 --seq 128 [--steps 8]
    python scripts/plan_standin.py --model bert-large-pretraining --mode train --batch 16 --count

--count traces one steady step (after the optimizer's state exists) and prints its unoptimized HLO
instructions and dot/convolution FLOPs per sample as JSON, never running it: the counts the published
training rows' host term and FLOPs are taken from (neuron_train/data/plan_published.yaml).
"""

from __future__ import annotations

import argparse
import json
import time

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
    "bert-large-pretraining": ("BertConfig", "BertForPreTraining",
                               dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                    intermediate_size=4096)),
    "vit-base-hf": ("ViTConfig", "ViTForImageClassification", {}),
    # openai/clip-vit-base-patch32: both towers, the contrastive loss of the fine-tuning example
    "clip-base-32": ("CLIPConfig", "CLIPModel", dict(vision_config=dict(patch_size=32))),
    # deepmind/language-perceiver: the PerceiverConfig defaults are that checkpoint's sizes
    "perceiver-language": ("PerceiverConfig", "PerceiverForMaskedLM", {}),
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
    if name == "clip-base-32":
        return torch.randint(0, 1000, (size, 77))
    if name in TIMM or name.startswith("vit"):
        return torch.randn(size, 3, 224, 224)
    return torch.randint(0, 1000, (size, seq))


def output_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out[0]


def forward(model: torch.nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """The model's output on a batch (CLIP: its contrastive loss over the batch's image-text pairs)."""
    if name == "clip-base-32":
        return model(input_ids=x, pixel_values=torch.randn(x.shape[0], 3, 224, 224, device=x.device),
                     return_loss=True).loss
    if name == "perceiver-language":
        return output_tensor(model(inputs=x))
    return output_tensor(model(x))


def count(model: torch.nn.Module, name: str, x: torch.Tensor) -> dict:
    """One steady training step traced (AdamW's state created first), read as HLO, never run."""
    from neuron_train.cost.plan.hlo import hlo_figures

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # Sync point: the state's creation runs now, apart from the step read next.
    torch_xla.sync()
    start = time.thread_time()   # the trace's CPU time: this thread builds the lazy graph op by op
    forward(model, name, x).float().pow(2).mean().backward()
    optimizer.step()
    traced_s = time.thread_time() - start
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    hlo = hlo_figures(torch_xla._XLAC._get_xla_tensors_hlo([*model.parameters(), *state]))
    return {"model": name, "instructions": hlo.instructions, "gflops_per_sample": hlo.flops / x.shape[0] / 1e9,
            "parameters_m": sum(p.numel() for p in model.parameters()) / 1e6, "trace_cpu_s": traced_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted([*ENCODERS, *TIMM]))
    parser.add_argument("--mode", choices=("infer", "train"), default="infer")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--count", action="store_true", help="print a training step's counts, run nothing")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch_xla.device()
    model = build(args.model).to(device)
    model.train(args.mode == "train")
    host_batch = batch(args.model, args.batch, args.seq)
    if args.count:
        print(json.dumps(count(model, args.model, host_batch.to(device))))
        return
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5) if args.mode == "train" else None
    for _ in range(args.steps):
        x = host_batch.to(device)
        if optimizer is None:
            with torch.no_grad():
                y = forward(model, args.model, x)
        else:
            loss = forward(model, args.model, x).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # Sync point: one step is one graph, as the published benchmarks' loops run it.
        torch_xla.sync()
    if optimizer is None:
        y.cpu()


if __name__ == "__main__":
    main()
