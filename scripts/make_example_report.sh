#!/usr/bin/env bash
# Rebuild docs/example-report/: real measurements of THIS machine (CPU XLA device, labelled so)
# plus imported, labelled rows of the Neuron SDK performance tables. Prints the figures.
# Its inputs live beside it, in docs/example-report-inputs/: a report folder holds only the report
# (it is replaced whole).
#   scripts/make_example_report.sh            # measure again, then report
#   scripts/make_example_report.sh --report   # only rebuild the report from the stored results
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/example-report
in=docs/example-report-inputs
nt=(python -m neuron_train)
export PJRT_DEVICE=CPU

if [[ "${1:-}" != "--report" ]]; then
  "${nt[@]}" bench --mode train --max-steps 33 --repeats 3 \
    --output "$in/results/local-train.json" --force
  "${nt[@]}" bench --mode infer --sweep --sweep-batch-sizes 16,32,64,128 --repeats 3 \
    --output "$in/results/local-infer.json" --force
fi

# --force: this folder is the generated example, rebuilt on purpose.
"${nt[@]}" report "$in"/results/local-train.json "$in"/results/local-infer.json \
  --reference "$in/references/trn1_training_data_vision_transformers.csv" \
  --reference "$in/references/inf2_throughput_data_vision_transformers.csv" \
  --reference "$in/references/inf2_throughput_data_vision_cnn.csv" \
  --reference "$in/references/inf1_throughput_data_cnn.csv" \
  --reference-model "ViT-Base fine-tuning" --reference-model google/vit-base \
  --reference-model resnet50 --reference-model resnet-50 \
  --prices "$in/prices-local.yaml" --out "$out" --force
