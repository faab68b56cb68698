#!/usr/bin/env bash
# Quick start on a fresh Debian/Ubuntu machine: installs the Debian packages, builds the trainer,
# turns the fortunes corpus into token shards and trains a small model, printing the losses and
# a sample at the end. Extra arguments go to the trainer (e.g. --max_steps 2000).
# On a machine with an NVIDIA GPU and nvcc it builds and uses the CUDA trainer, otherwise the CPU
# reference trainer (OpenMP, all cores).
set -euo pipefail
cd "$(dirname "$0")/.."

packages="g++ make python3 fortunes doctest-dev libopenmpi-dev openmpi-bin"
missing=$(for p in $packages; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing" ]; then
    sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
    echo "installing:" $missing
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi

trainer=./train_gpt_cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && make train_gpt && [ -x train_gpt ]; then
    trainer=./train_gpt
else
    make train_gpt_cpu
fi
if [ ! -f data/fortunes/fortunes_val_000.bin ]; then
    python3 dev/data/prepare_text.py /usr/share/games/fortunes --sep percent --out_dir data/fortunes
fi
rc=0
$trainer --out_dir out/quickstart --max_steps 700 --val_every 100 --sample_len 400 "$@" || rc=$?
# 75: stopped by a signal (Ctrl-C) after a checkpoint; the run so far is in the log all the same
[ $rc -eq 75 ] && echo "stopped early: continue with scripts/quickstart.sh --resume latest"
[ $rc -eq 0 ] || [ $rc -eq 75 ] &&
    echo "plot the run: make tools && .venv-tools/bin/python scripts/plot.py out/quickstart  (-> out/quickstart/plot.png)"
exit $rc
