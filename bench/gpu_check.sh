#!/usr/bin/env bash
# The GPU check (docs/gpu.md): the CUDA tests, the attention kernel benchmark, the prefill
# benchmark (Llama-3.2-3B shape, random weights, bf16) at 8K/32K, a latency profile of the
# SmolLM2 shape and a short TTFT sweep with it, in
# one go, each phase under its own time limit so that one slow phase cannot take the others' time.
#
#   bash bench/gpu_check.sh [OUTDIR]      # default bench/results; JSON named per GPU
#
# Environment:
#   GPU_CHECK_PHASES   which phases (default "tests attention prefill prefill1k profile ttft";
#                      also prefill1kprof: the T=1024 prefill under the profiler; ttftlong:
#                      the whole ask at 8K/16K/32K, Llama-3.2-1B shape, 100/500/850 Mbit/s;
#                      devicekv: the LLMS service with its KV memory on the GPU, with and
#                      without the host-RAM tier; ttftswitch: ttftlong's 32K points with a
#                      200 us GIL switch interval, SPARKV_SWITCH_INTERVAL_US; ttftnetns:
#                      ttftlong's 32K points over a veth that tc shapes, the client not
#                      shaping: root and iproute2, else it says why and stops)
#   GPU_CHECK_WHEELS   a folder of wheels to install first (a machine that cannot reach PyPI)
#   SPARKV_TOKENIZER   a tokenizer folder for the random SmolLM2-shape model of the TTFT phase
#                      (default: the bundled SmolLM2's, once converted)
# The device machine's own recipe (a bare image with PyTorch): see docs/gpu.md, "Running the check".
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-bench/results}")
mkdir -p "$out"
phases=${GPU_CHECK_PHASES:-"tests attention prefill prefill1k profile ttft"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu-check-site "$GPU_CHECK_WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/gpu-check-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
gpu=$($PY -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>/dev/null)
if [ -z "$gpu" ]; then echo "gpu_check: no CUDA device here; nothing to check"; exit 0; fi
tag=$(echo "$gpu" | tr 'A-Z' 'a-z' | sed -e 's/nvidia//' -e 's/[^a-z0-9]\+/-/g' -e 's/^-//' -e 's/-$//' | cut -d- -f1-2)
tmp=$(mktemp -d)
echo "gpu_check: $gpu (tag $tag), phases: $phases"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
$PY -c "import sparkv.cli" || { echo "gpu_check: sparkv does not import"; exit 1; }

phase() {   # phase NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  case " $phases " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*"
  timeout --signal=INT --kill-after=15 "$limit" "$@"
  echo "=== $name: exit $? after $((SECONDS - t0))s"
  cp "$tmp"/*.json "$out"/ 2>/dev/null   # each phase's JSON at once: a later phase cut short
}                                        # (or the device command's own limit) keeps it
BENCH="$PY -m sparkv.cli bench"

phase tests 200 $PY -m pytest -q -p no:cacheprovider tests/test_runtime_device.py \
  tests/test_runtime_split.py tests/test_device_paths.py tests/test_qattend.py \
  tests/test_dynakv_batched.py tests/test_runtime_sparsecal.py tests/test_flex_pipeline.py \
  "tests/test_device_kv_generic.py::test_cuda_llms_service_keeps_its_memory_on_the_gpu_and_reads_it_back_exactly" \
  tests/test_device_kv_generic.py::test_cuda_dynakv_decodes_exactly_like_full_kv \
  tests/test_layer_graphs.py::test_cuda_graphs_give_the_eager_steps_kv -rs
# 32K only (the target's length; sparse never won at 8K on the H100 or H200): flex compiles
# for each shape, 30-40 s each on the H200 in run 3, where 8 shapes did not fit 100 s.
# --profile-predict: where the prediction's 4-5 ms at 32K go (40% of dense in run 3)
phase attention 200 $BENCH attention --heads 24/8/128,9/3/64 --lengths 32768 \
  --densities 0.1,0.25,0.5 --repeats 3 --save-profile --profile-predict \
  --out "$tmp/attention-$tag.json"
phase prefill 90 $BENCH prefill --device cuda --model random:llama-3.2-3b \
  --sizes 8192,32768 --chunk-tokens 4096 --repeats 3 --max-new-tokens 4 \
  --variants full,dense,dense+fused,auto --out "$tmp/prefill-$tag.json"
# issue 46's launch-bound T=1024: the stepper step by step (with the CUDA graphs a GPU's steps
# replay, and eager), layer by layer, and the edge engine's local load with its spans
# (CommitSpans, the GPU's default) and without them
phase prefill1k 150 $BENCH prefill --device cuda --model random:llama-3.2-3b \
  --sizes 32768 --chunk-tokens 1024 --repeats 2 --max-new-tokens 4 \
  --variants full,dense,dense+eager,dense+fused,dense+engine,dense+steps \
  --out "$tmp/prefill-t1024-$tag.json"
phase prefill1kprof 60 $BENCH prefill --device cuda --model random:llama-3.2-3b \
  --sizes 32768 --chunk-tokens 1024 --repeats 1 --max-new-tokens 4 \
  --variants full,dense --profile dense --out "$tmp/prefill-t1024-profile-$tag.json"
# the edge's latency model for the TTFT phase's model on this GPU (without it the planners use
# the roofline alone, which has no per-launch term: GPU steps ran 3-4x slower than it predicted)
phase profile 120 $PY -m sparkv.cli profile --model random:smollm2-135m --device cuda \
  --quick --tokens 4096 --chunk-sizes 256,512,1024 --loads 0 --cdf '' --no-progress \
  --train --out "$tmp/profile-samples-$tag.json"
phase ttft 150 $BENCH ttft --device cuda --model random:smollm2-135m --sizes 4096 \
  --mbps 500 --trace lte --runs 1 --max-new-tokens 8 --levels q8,q5 --json \
  --out "$tmp/ttft-$tag.json"
# issue 46's whole ask at long contexts (random weights of a real shape, labelled in the JSON;
# the Llama shape borrows SmolLM2's tokenizer, whose ids are within its vocabulary); 32K and
# 500 Mbit/s first, 100 Mbit/s (the slow streams) last, so a phase cut short keeps the target;
# 512-token chunks: its 8 KV heads x 64 channels make a 1024-token chunk's raw bf16 frame 72
# bytes over the server's 2 MiB frame limit (the H200's run 3 was refused: frame_too_large)
tok=${SPARKV_TOKENIZER:-$($PY -c "from sparkv.runtime.model import cache_dir; print(cache_dir() / 'models' / 'SmolLM2-135M-Instruct')" 2>/dev/null)}
phase ttftlong 420 env SPARKV_TOKENIZER="$tok" $BENCH ttft --device cuda --model random:llama-3.2-1b \
  --sizes 32768,8192,16384 --chunk-tokens 512 --mbps 500,850,100 --trace '' --runs 1 \
  --max-new-tokens 4 --levels q8,q5 --json --out "$tmp/ttft-long-$tag.json"
# ttftlong's 32K points with a 200 us GIL switch interval (CPython's is 5 ms): in run 3 the
# launches starved beside the plan's and the frames' Python (docs/gpu.md), compare with ttftlong
phase ttftswitch 200 env SPARKV_TOKENIZER="$tok" SPARKV_SWITCH_INTERVAL_US=200 $BENCH ttft \
  --device cuda --model random:llama-3.2-1b --sizes 32768 --chunk-tokens 512 --mbps 500,850 \
  --trace '' --runs 1 --max-new-tokens 4 --levels q8,q5 --json --out "$tmp/ttft-switch-$tag.json"
# ttftlong's 32K points over a real shaped path (the server in a network namespace, tc on its
# veth; docs/netns.md): the client's shaper paces every piece of every chunk in Python beside the
# launches, so this separates the emulation's share of run 3's slower compute beside the link
# (compute_vs_local) from the receive path's own; without root or iproute2 it says why and stops
phase ttftnetns 200 env SPARKV_TOKENIZER="$tok" $BENCH ttft --device cuda \
  --model random:llama-3.2-1b --sizes 32768 --chunk-tokens 512 --mbps 500,850 --trace '' \
  --runs 1 --max-new-tokens 4 --levels q8,q5 --link netns --json \
  --out "$tmp/ttft-netns-$tag.json"
# issue 46's device KV memory on the GPU: the LLMS service with its pages there, without and
# with the host-RAM tier between them and flash (a short trace of 6 contexts; the SmolLM2 shape
# with random weights: the bundled weights do not travel, its tokenizer does)
phase devicekv 150 env SPARKV_TOKENIZER="$tok" $BENCH contexts --device cuda \
  --model random:smollm2-135m --quick --systems vllm-sq,llms,llms+host --sweep '' \
  --ask-tokens 0 --json --out "$tmp/contexts-$tag.json"
cp "$tmp"/*.json "$out"/ 2>/dev/null
ls -la "$out"
