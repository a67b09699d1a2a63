#!/usr/bin/env bash
# GPU benchmark stages, run from the repository root on an NVIDIA machine with MLX's
# CUDA build installed from its wheels (into /opt/mlx here, which goes on PYTHONPATH).
# Usage: bash tests/bench/gpu_run.sh STAGE (no STAGE, or help: this table).
#
# Results go to $OUT (default /tmp/out); the ones kept are committed under
# tests/bench/results/, each into its topic's folder (results/README.md says which) and
# named by what it holds, never by when it ran. Bench stages also write their progress
# lines beside their JSON (NAME.progress), so a run cut off by a time limit still says
# what it measured. Each
# stage is meant to finish within 10 minutes; stages marked q30 need make-q30 first
# (its model and store are in /root/q30).
# Environment variables that vary a stage are described at the stage below; MLX_LIMIT
# lowers the MLX memory cap of the bench stages that set one (100G suits the H200; 60G an H100).
#
# setup
#   make-q30             Qwen3-30B-A3B-shaped random 4-bit model (realistic routing) and its store
#   chain S1 S2 ...      stages in turn, each under STAGE_TIMEOUT seconds (default 400)
# exactness
#   exactness-mini       GPU exactness check: streaming vs stock mlx-lm bit for bit, every pool kind, 4-bit and bf16
#   exactness-old        the same cases on an older tree (OLD_TAR), to tell whether a failure predates a change
#   crash-matrix         the slot-pool illegal-memory-access crash, REPS runs per VARIANTS
#   exactness            the CPU test suite under MLX's CUDA build (CUDA kernels differ: see tests/bench/README.md)
# decode (bench decode)
#   decode-q30           q30: stock, 100%, 25% (+host mapped, +host:slots), naive; 100% vs stock in A B B A blocks
#   decode-q30-table     q30: 50% and 12.5%, with and without the host tier
#   optimistic-q30       q30: pools near full checking residency every few layers against a sync at every layer
#   plan-q30             q30: `moestreamctl plan`'s forecast beside bench decode at 50% and 25%, with and without the host tier
#   heat-q30             q30: requests through a daemon at 25% + 20G host tier, for the heat and reuse files plan-q30 reads
#   gen-demo             the daemon's generation loop against the bench loop, demo model
#   spec-demo            speculative decoding with the demo's MTP head against plain decode
#   elastic-demo         the elastic pool on the demo at 50% (slot pool, page-locked 2M host tier): resizes against none and stock, shrink/grow times, tok/s before/while/after
# prefill (bench prefill)
#   prefill-q30          q30: time to first token at 512/2048/8192 tokens: stock, 100%, 25% disk (and chunk order), 25% + 20G host
# serving (bench serve)
#   serve-q30            q30: 1, 2, 4, 8 clients through a real daemon at 100% and at 25% + 20G host tier
#   row-batch-q30        q30: a request's logits bit for bit alone and in batches of 2-8 (stock, 100%, 25% + host), then row-batch-cuda
#   row-batch-cuda       tests/test_row_batch.py under MLX's CUDA build (every architecture's tiny model)
#   batch-bound-q30      q30: a batch step of 1 and 4 on partial pools (CAPACITIES, default "0.9 0.25") against its bound, A B B A
# agents (bench agent)
#   agent-q30            q30: a coding agent's 16k-token prompt through a daemon and gateway at 25% + 20G host, then 25% disk only
#   session-q30          q30: a Claude Code session replayed through a daemon and gateway, prompt cache off then on, 100% and 25% disk
# prompt cache (bench chat)
#   chat-q30             q30: a 4-turn chat over a 2048-token history, prompt cache off and on, at 100% and 25% + 20G host
# prefetch (bench predict)
#   predict-q30          q30: predictor recall; prefetch off/on with a host tier (HOST_CACHE, CAPACITY, DEPTH, ...)
#   predict-depth-q30    q30: prefetch where the disk is the bound (25%, no host tier) by depth and buffer
# warm start (bench warmstart)
#   warmstart-q30        q30: time to 64 tokens after a restart at 25%, cold vs autopinned
#   warmstart-q30-host   the same with a 20G host tier filled from the heat before ready
#   warmstart-q30-mapped the same with mapped pools
# probes (scripts in tests/bench)
#   copy-check           the CUDA copier: exact bytes, memory kinds, host->GPU GB/s, per-span vs kernel
#   shape                attention and forwards at new vs seen key lengths (why speculation pads them), demo model
#   residency-q30        q30: admission copies by CUDA streams; 100% vs stock; kernels reading host memory (zero-copy)
#   full-residency       q30: where 100% could lose to stock (host time split; ABBA=N blocks of A B B A)
#   gather-q30           q30: one mapped layer, zero-copy expert call vs gathering the routed experts first
#   background-copy      q30: how much of a copy made ahead of use hides beside a layer's kernels, by blocks
#   plan-probe           plan's compute probe against longer runs, 24 layers, bench's loop, and (PROBE_STORE) the store's own model
#   continuation-q30     q30: a chat turn's continuation after a 2048-token cache, stock's forward against the padded one
#   mapped-batch         q30: a mapped pool's batched step by requests: the copy's GB/s by rows, steps against a full pool, repeats copied or not, moves, zero-copy
#   routing-probe        a full pool's routing read-back: the host's microseconds per token (48 layers)
#   hang-probe           q30: stock mlx-lm's prefills and decodes timed one by one (a first one compiles MLX's kernels), by MLX launch switch (HANG_ENVS, SECONDS_EACH)
#   ptx-pack             MLX's compiled CUDA kernels as $OUT/mlx_ptx.tgz, for PTX_TAR in a later lease
#   batch-probe          where a batched decode step's time goes at B = 1, 2, 4, 8, and with its attention changed (EXTRA=--parts: one layer's halves; PROBE_STORE: a store's models and the daemon's loop)
# demo
#   demo                 train the built-in demo model (tests/bench/demo_recipe, DEMO_MINUTES)
set -euo pipefail
stage=${1:-help}
if [ "$stage" = help ] || [ "$stage" = -h ] || [ "$stage" = --help ]; then
  # The table is the header above: print it, not a copy that could drift.
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
  exit 0
fi
if ! grep -qE "^#   $stage( |\$)" "$0"; then
  echo "unknown stage $stage (bash $0 help lists them)" >&2; exit 2
fi
export PYTHONPATH=/opt/mlx:$PWD
# MLX's CUDA build compiles most kernels (NVRTC) the first time it meets them: on a fresh
# machine stock's first 171-token prefill took 118 s with the GPU idle (2026-12-07,
# RESULTS.md "Wave 3 on the GPU"), which stage limits took for stalls. One folder keeps
# them for every stage, filled from PTX_TAR (what an earlier lease's ptx-pack wrote)
# where given, so that a lease need not compile them again.
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/root/mlx-ptx}
if [ -n "${PTX_TAR:-}" ] && [ ! -e "$MLX_PTX_CACHE_DIR/.from-tar" ]; then
  mkdir -p "$MLX_PTX_CACHE_DIR" && tar xzf "$PTX_TAR" -C "$MLX_PTX_CACHE_DIR" && touch "$MLX_PTX_CACHE_DIR/.from-tar"
fi
# A native abort then prints the Python stack of every thread.
export PYTHONFAULTHANDLER=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the demo stage runs from tests/bench
py=python3
ctl() { $py -m moestream.client.cli "$@"; }

if ! $py -c "import moestream._native" 2>/dev/null; then
  $py -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
$py -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
# The package's imports, checked before any stage: one missing on the machine (greenlet,
# which the layer-major prefill needs since wave 3) once cost a lease every stage it had.
$py -c "import importlib.util as u, sys; m = [n for n in sys.argv[1:] if u.find_spec(n) is None]; sys.exit(f'missing here: {m} (stage their cp312 wheels beside MLX\'s)' if m else 0)" \
  greenlet zmq msgpack click psutil safetensors huggingface_hub mlx_lm

case "$stage" in
  chain)
    # Several stages in one device call, each under its own limit (STAGE_TIMEOUT seconds,
    # default 400), so that one that overruns costs its own figures, not the others':
    #   bash tests/bench/gpu_run.sh chain make-q30 exactness-mini decode-q30
    # A stage that overruns first gets SIGABRT in its Python processes, whose fault handler
    # (PYTHONFAULTHANDLER) prints every thread's stack into the stage's log, then it and
    # everything under it are killed: a stalled run says where it stalled.
    shift
    descendants() { local c; for c in $(ps -o pid= --ppid "$1"); do echo "$c"; descendants "$c"; done; }
    for s in "$@"; do
      echo "== $s"
      bash "$0" "$s" &
      pid=$!
      (
        sleep "${STAGE_TIMEOUT:-400}"
        echo "== $s ran past ${STAGE_TIMEOUT:-400} s: stopped (its Python stacks are in its log)"
        for p in $(descendants "$pid"); do case "$(ps -o comm= -p "$p")" in python*) kill -ABRT "$p" ;; esac; done
        sleep 10
        kill -KILL "$pid" $(descendants "$pid")
      ) 2>/dev/null &
      watcher=$!
      rc=0; wait "$pid" || rc=$?
      # Its sleep too: left running, it holds the call's output open to its end.
      kill $(descendants "$watcher") "$watcher" 2>/dev/null || true
      [ "$rc" = 0 ] || echo "== $s failed or timed out (exit $rc)"
    done
    ;;
  exactness)
    # Beside exactness, the pool's tests (all but a size-formatting one, in test_settings.py).
    $py -m pytest -q -p no:cacheprovider tests/test_exactness.py tests/test_native_engine.py \
      tests/test_expert_pool.py tests/test_capacity.py tests/test_autopin.py tests/test_host_tier.py \
      tests/test_admission.py tests/test_expert_reader.py tests/test_streaming_model.py tests/test_generation.py \
      tests/test_cli_generate.py tests/test_bench_decode.py \
      2>&1 | tee "$OUT/exactness_cuda.txt" | tail -15
    ;;
  copy-check)
    $py tests/bench/gpu_copy_check.py --out "$OUT/copy_check.json"
    ;;
  predict-q30)
    # With a host tier that holds every expert (HOST_CACHE=0 for none, or a size that
    # holds part of them, e.g. 8G: predicted experts it lacks are then read from disk
    # while the GPU computes): predicted experts in the tier are copied into the next
    # layer's slots while the GPU computes.
    # CAPACITY=0.25 measures one capacity only;
    # COPY_KERNEL=1 copies with the copy kernel (the default now; kept so that the
    # file names say so); PF_BLOCKS=N caps it at N blocks per span for prefetch's
    # copies (default 64; see gpu_background_copy_probe.py). DEPTH=N reads
    # N layers ahead (setting prefetch_depth); ROUNDS=N blocks of off/on/on/off (default 3);
    # PF_BUFFER=SIZE sizes the prefetch buffer (setting prefetch_buffer); POLICY=lfu|lfuda|predictive evicts by another policy
    # than LRU (fewer misses leave prefetch a larger share of the time to hide).
    f="$OUT/bench_predict_q30${HOST_CACHE:+_host$HOST_CACHE}${COPY_KERNEL:+_kernel}${PF_BLOCKS:+_b$PF_BLOCKS}${DEPTH:+_d$DEPTH}${PF_BUFFER:+_buf$PF_BUFFER}${ROUNDS:+_r$ROUNDS}${POLICY:+_$POLICY}${MLX_MAX_OPS_PER_BUFFER:+_ops$MLX_MAX_OPS_PER_BUFFER}_h200.json"
    ctl bench predict --model /root/q30/store --temp 1 --host-cache ${HOST_CACHE:-20G} --depth ${DEPTH:-1} --rounds ${ROUNDS:-3} \
      ${PF_BUFFER:+--prefetch-buffer $PF_BUFFER} --policy ${POLICY:-lru} \
      ${CAPACITY:+--capacity $CAPACITY} ${COPY_KERNEL:+--copy-kernel} --prefetch-copy-blocks ${PF_BLOCKS:-64} \
      --prompt-tokens ${PROMPT_TOKENS:-8} --decode-tokens ${DECODE_TOKENS:-48} --mlx-memory-limit 64G --json >"$f" 2> >(tee "$f.progress" >&2)
    $py - "$f" <<'EOF'
import json, sys
from moestream.daemon.bench.predict import format_report
print(format_report(json.load(open(sys.argv[1]))))
EOF
    ;;
  predict-depth-q30)
    # Prefetch where the disk is the bound (no host tier, 25%): reads of one layer's
    # misses take longer than a layer's compute, so depth 1 starts them too late
    # (with an 8 GB tier, half the prefetched experts were still in flight when used).
    # DEPTHS="1 2" by default, 16 tokens a decode after a 4-token prompt (each decode's
    # prompt reads a few GB at 25%), 3 blocks each: about 4 minutes per depth.
    # Measured 1.05x, 1.18x, 1.15x at depths 1, 2, 3 (predict/bench_predict_q30_depth*_h200.json);
    # at depth 3 prefetch read at about 0.95 of the disk's bandwidth, 10 to 12% of it for
    # experts never routed. BUFFERS="0 4G" runs each depth with each prefetch buffer size
    # (0: the default); a buffer that keeps unrouted reads until a later token routes
    # them (4G at depth 2: none dropped) gave 1.25x and 1.21x. HOST_CACHE=8G puts a host
    # tier under the pool instead of none.
    for d in ${DEPTHS:-1 2}; do
     for b in ${BUFFERS:-0}; do
      pf_buffer=$b; [ "$b" = 0 ] && pf_buffer=
      HOST_CACHE=${HOST_CACHE:-0} CAPACITY=0.25 DEPTH=$d PF_BUFFER=$pf_buffer DECODE_TOKENS=${DECODE_TOKENS:-16} PROMPT_TOKENS=${PROMPT_TOKENS:-4} \
        timeout "${STAGE_TIMEOUT:-280}" bash "$0" predict-q30 \
        || echo "predict-depth-q30: depth $d, buffer $b failed or timed out (exit $?)"
     done
    done
    ;;
  shape)
    $py tests/bench/gpu_shape_probe.py --store daemon/demo/store --out "$OUT/shape_probe_h200.json" 2>&1 | tail -12
    ;;
  residency-q30)
    $py tests/bench/gpu_residency_probe.py --store /root/q30/store --out "$OUT/residency_q30.json" 2>&1 | tail -40
    ;;
  full-residency)
    $py tests/bench/gpu_full_residency_probe.py --store /root/q30/store --rounds "${ROUNDS:-5}" --abba "${ABBA:-0}" --out "$OUT/full_residency_q30${ABBA:+_abba}_h200.json" 2>&1 | tail -60
    ;;
  gather-q30)
    $py tests/bench/gpu_gather_probe.py --store /root/q30/store --out "$OUT/gather_probe_h200.json" 2>&1 | tail -4
    ;;
  exactness-mini)
    # ONLY=regex runs the matching cases (labels like 32-slots, 4-tier, 8-mapped+gather);
    # TAG names the output files of one such run. COLLECT=1 releases each model before
    # the next loads (see the crash notes in tests/bench/results/exactness/exactness_gpu_mini_mapped_prefetch_h200.json).
    $py tests/bench/gpu_exactness_check.py --out "$OUT/exactness_gpu_mini${TAG:+_$TAG}.json" --steps "${STEPS:-16}" \
      --bits "${BITS:-4,0}" --only="${ONLY:-}" ${COLLECT:+--collect} >"$OUT/exactness_gpu_mini${TAG:+_$TAG}.log" 2>&1 || { tail -30 "$OUT/exactness_gpu_mini${TAG:+_$TAG}.log"; exit 1; }
    tail -3 "$OUT/exactness_gpu_mini${TAG:+_$TAG}.log"
    ;;
  exactness-old)
    # The exactness check's cases (ONLY, default the slot pools) on an older tree, to
    # tell whether a failure predates the changes since: OLD_TAR is
    # `git archive REV --prefix=moestream/ -o .gpu/old.tar`, carried to the device.
    rm -rf /tmp/old && mkdir -p /tmp/old && tar -xf "${OLD_TAR:-.gpu/old.tar}" -C /tmp/old
    (cd /tmp/old/moestream && $py setup.py build_ext --inplace >"$OUT/old_build.log" 2>&1) || { tail -20 "$OUT/old_build.log"; exit 1; }
    PYTHONPATH=/opt/mlx:/tmp/old $py -c "import moestream, sys; print('moestream from', moestream.__file__)"
    PYTHONPATH=/opt/mlx:/tmp/old $py tests/bench/gpu_exactness_check.py --out "$OUT/exactness_old.json" --steps "${STEPS:-16}" \
      --bits "${BITS:-4}" --only="${ONLY:-slots}" >"$OUT/exactness_old.log" 2>&1 || { tail -8 "$OUT/exactness_old.log"; exit 1; }
    tail -3 "$OUT/exactness_old.log"
    ;;
  crash-matrix)
    # The slot-pool crash (exactness/exactness_gpu_mini_mapped_prefetch_h200.json), REPS runs per
    # variant, 4-bit, 16 steps: the four slot pools in turn (default); each model released
    # before the next loads (collect); the fully resident 32-slot model alone (only32);
    # and collect's three steps one at a time (release: dropped before the next loads;
    # sync: mx.synchronize; clear: mx.clear_cache), to tell which keeps the crash away.
    for v in ${VARIANTS:-default collect only32}; do
      for i in $(seq "${REPS:-6}"); do
        case $v in
          default) extra=(--only='-slots$') ;;
          collect) extra=(--only='-slots$' --collect) ;;
          only32) extra=(--only='^32-slots$') ;;
          release|sync|clear) extra=(--only='-slots$' --between=$v) ;;
          *) echo "crash-matrix: unknown variant $v" >&2; exit 2 ;;
        esac
        rc=0
        timeout 90 $py tests/bench/gpu_exactness_check.py --out "$OUT/crash_${v}_$i.json" --steps 16 --bits 4 "${extra[@]}" >"$OUT/crash_${v}_$i.log" 2>&1 || rc=$?
        echo "$v $i rc=$rc cases=$(grep -c tokens_equal "$OUT/crash_${v}_$i.log") $(grep -o 'illegal memory access' "$OUT/crash_${v}_$i.log" | head -1)" | tee -a "$OUT/crash_matrix.txt"
        rm -f "$OUT/crash_${v}_$i.json"; grep -q illegal "$OUT/crash_${v}_$i.log" || rm -f "$OUT/crash_${v}_$i.log"
      done
    done
    ;;
  plan-probe)
    # PROBE_STORE=/root/q30/store also times that store's model as bench decode loads stock;
    # EMBED_SCALE=64 also times each random model routing as make-q30's store routes.
    $py tests/bench/gpu_plan_probe.py --repeats "${REPEATS:-3}" ${PROBE_STORE:+--store "$PROBE_STORE"} \
      ${EMBED_SCALE:+--embed-scale "$EMBED_SCALE"} \
      --out "$OUT/plan_probe_h200.json" 2>&1 | tail -16
    ;;
  continuation-q30)
    $py tests/bench/gpu_continuation_probe.py --store /root/q30/store --out "$OUT/continuation_probe_h200.json" 2>&1 | tail -10
    ;;
  batch-probe)
    # PROBE_STORE (e.g. /root/q30/store after make-q30): the store's streaming and stock
    # models and the daemon's request loop in-process, instead of a random LAYERS-layer model.
    if [ -n "${PROBE_STORE:-}" ]; then
      $py tests/bench/gpu_batch_probe.py --store "$PROBE_STORE" --steps "${STEPS:-30}" --rounds "${ROUNDS:-2}" \
        --out "$OUT/batch_probe${TAG:+_$TAG}_h200.json" 2>&1 | tail -12
    else
      $py tests/bench/gpu_batch_probe.py --layers "${LAYERS:-12}" --steps "${STEPS:-30}" --rounds "${ROUNDS:-3}" ${EXTRA:---attention} \
        --out "$OUT/batch_probe_h200.json" 2>&1 | tail -10
    fi
    ;;
  ptx-pack)
    tar czf "$OUT/mlx_ptx.tgz" -C "$MLX_PTX_CACHE_DIR" --exclude=.from-tar . && ls -la "$OUT/mlx_ptx.tgz"
    ;;
  hang-probe)
    # Two stages stalled waiting on an H200 (2026-12-07), one of them on stock alone: the
    # next lease found MLX compiling kernels (a first prefill of 118 s, the GPU idle and its
    # memory unfilled meanwhile, then 4 decodes in 0.07 s). Each
    # setting of HANG_ENVS (";"-separated, "default" for none) runs gpu_hang_probe.py for
    # SECONDS_EACH (60) seconds beside nvidia-smi's utilisation, until one runs clean
    # (STOP_AT_CLEAN=1, the default) or all have run; the clean one is in $OUT/hang_clean.
    IFS=';' read -ra envs <<< "${HANG_ENVS:-default;MLX_USE_CUDA_GRAPHS=0;MLX_CUDA_USE_CUDNN_SDPA=0}"
    for e in "${envs[@]}"; do
      name=$(echo "$e" | tr -c 'A-Za-z0-9_\n' _)
      nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader -l 2 > "$OUT/hang_smi_$name.txt" 2>&1 &
      smi=$!
      rc=0
      # shellcheck disable=SC2046  # "default" sets nothing
      env $( [ "$e" = default ] || echo "$e" ) $py tests/bench/gpu_hang_probe.py --store /root/q30/store \
        --seconds ${SECONDS_EACH:-60} --mlx-memory-limit ${MLX_LIMIT:-100G} > "$OUT/hang_probe_$name.txt" 2>&1 || rc=$?
      kill $smi 2>/dev/null || true
      echo "$e: exit $rc; $(grep -c prompt "$OUT/hang_probe_$name.txt") prompts; $(tail -1 "$OUT/hang_probe_$name.txt")"
      if [ $rc = 0 ]; then echo "$e" > "$OUT/hang_clean"; [ "${STOP_AT_CLEAN:-1}" = 1 ] && break; fi
    done
    ;;
  mapped-batch)
    $py tests/bench/gpu_mapped_batch_probe.py --store /root/q30/store --out "$OUT/mapped_batch_probe_h200.json" 2>&1 | tail -30
    ;;
  routing-probe)
    $py tests/bench/resident_routing_probe.py | tee "$OUT/resident_routing_probe_h200.json"
    ;;
  background-copy)
    $py tests/bench/gpu_background_copy_probe.py --store /root/q30/store --out "$OUT/background_copy_probe_h200.json" 2>&1 | tail -12
    ;;
  make-q30)
    rm -rf /root/q30 && mkdir -p /root/q30
    # EMBED_SCALE=64 routes about as varied as a real model (LRU hits 0.29 at 25%); 1 keeps
    # mlx-lm's initialisation, whose routing barely changes between tokens (0.95).
    /usr/bin/time -v $py tests/bench/make_random_moe.py --shape qwen3-30b-a3b --out /root/q30/model --embed-scale ${EMBED_SCALE:-64} --mlx-memory-limit 64G 2>&1 | grep -E "wrote|Elapsed|Maximum resident" | tee "$OUT/make_q30.txt"
    /usr/bin/time -v $py -m moestream.client.cli convert /root/q30/model --out /root/q30/store 2>&1 | grep -E "wrote|Elapsed|Maximum resident|Error" | tee -a "$OUT/make_q30.txt"
    rm -rf /root/q30/model
    df -h /root | tail -1
    ;;
  prefill-q30)
    # Issue 26's acceptance run: every configuration side by side, RUNS (2) runs per
    # prompt (the last is reported: the first of a shape may compile kernels), a warm-up
    # prompt of WARMUP (2100: two chunks) tokens per configuration. PROMPTS, EXTRA vary it.
    $py -m moestream.client.cli bench prefill --model /root/q30/store --capacity 0.25 --host-cache 20G --chunked \
      $(for n in ${PROMPTS:-512 2048 8192}; do echo --prompt-tokens $n; done) --runs ${RUNS:-2} --warmup-tokens ${WARMUP:-2100} \
      --mlx-memory-limit ${MLX_LIMIT:-100G} --out "$OUT/bench_prefill_q30${TAG:+_$TAG}_h200.json" ${EXTRA:-} \
      2> >(tee "$OUT/bench_prefill_q30${TAG:+_$TAG}_h200.progress" >&2) | tee "$OUT/bench_prefill_q30${TAG:+_$TAG}_h200.txt"
    ;;
  serve-q30)
    # Concurrent clients through one real daemon per pool (REQUESTS per level, 64 tokens
    # each at temperature 1, seeded), 100% then 25% + a 20G host tier; MAX_BATCH is the
    # daemon's max_batch (0: its default, up to 8 where its steps measure it faster; 1: turns); POOLS="1.0"
    # measures one pool; pools are separated by ";", as in the default (a pool given alone
    # with its words, "0.25 --host-cache 20G", is one pool, not three). ROUNDS runs every
    # level that many times, every other round in reverse, for medians (the host's pace drifts).
    # AGAINST_TURNS=1 runs each level through a second daemon whose requests take turns too;
    # CLIENTS ("1 4") the levels (default 1 2 4 8).
    IFS=';' read -ra pools <<< "${POOLS:-1.0;0.25 --host-cache 20G}"
    for pool in "${pools[@]}"; do
      name=$(echo "$pool" | cut -d' ' -f1)
      # shellcheck disable=SC2086  # a pool's words are bench serve's arguments
      $py -m moestream.client.cli bench serve --model /root/q30/store --capacity $pool --requests ${REQUESTS:-16} \
        $(for c in ${CLIENTS:-}; do echo --clients $c; done) \
        --max-batch ${MAX_BATCH:-0} --max-tokens 64 --rounds ${ROUNDS:-1} ${AGAINST_TURNS:+--against-turns} --json > "$OUT/bench_serve_q30_${name}_h200.json" \
        2> "$OUT/bench_serve_q30_${name}_h200.progress" \
        || tail -5 "$OUT/bench_serve_q30_${name}_h200.progress"
    done
    ;;
  session-q30)
    # Issue 60 run 2's session: reuse and total prefill, cache off against on, per pool
    # (POOLS as serve-q30's).
    IFS=';' read -ra pools <<< "${POOLS:-0.25 --host-cache 20G;0.25}"
    for pool in "${pools[@]}"; do
      name=$(echo "$pool" | tr -d ' -.' )
      # shellcheck disable=SC2086  # a pool's words are bench session's arguments
      ctl bench session --model /root/q30/store --capacity $pool --json > "$OUT/bench_session_q30_${name}.json" \
        2> "$OUT/bench_session_q30_${name}.progress" || tail -5 "$OUT/bench_session_q30_${name}.progress"
    done
    ;;
  row-batch-q30)
    # Issue 60 run 4's bit-identity check on the q30 model (TRIALS companion sets per batch
    # size; CAPACITIES, default "1 0.25", the latter with a 20G host tier), then the CPU
    # suite's batch-invariance tests under MLX's CUDA build.
    $py tests/bench/gpu_row_batch_probe.py --store /root/q30/store $(for c in ${CAPACITIES:-1 0.25}; do echo --capacity $c; done) --host-cache 20G \
      --trials ${TRIALS:-1} --mlx-memory-limit ${MLX_LIMIT:-100G} --out "$OUT/row_batch_probe_q30.json" \
      2> "$OUT/row_batch_probe_q30.progress" | tail -3
    grep -c 'same False' "$OUT/row_batch_probe_q30.progress" || true
    bash "$0" row-batch-cuda
    ;;
  row-batch-cuda)
    # tests/test_row_batch.py under MLX's CUDA build, each test's verdict written as it
    # ends (a run cut by its limit still says how far it got; through a pipe, pytest's
    # buffered output once came back empty), spread over WORKERS processes (default 8)
    # where pytest-xdist is there: the first run of each tiny model compiles its kernels.
    n=$($py -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8}")
    $py -u -m pytest -vv -p no:cacheprovider $n tests/test_row_batch.py >"$OUT/test_row_batch_cuda.txt" 2>&1
    tail -8 "$OUT/test_row_batch_cuda.txt"
    ;;
  batch-bound-q30)
    # Issue 56 point 5: the daemon's batch step on a partial pool (misses read from the
    # disk) against the same step on a full pool plus its bytes over the store's measured
    # bandwidth; both models loaded at once (about 32 GB at 0.9).
    for c in ${CAPACITIES:-0.9 0.25}; do
      f="$OUT/batch_bound_probe_q30_${c/./}.json"
      $py tests/bench/batch_bound_probe.py --store /root/q30/store --capacity "$c" --batch 1 --batch 4 \
        --steps ${STEPS:-16} --blocks ${BLOCKS:-4} --out "$f" >"$f.txt" 2>"$f.progress" \
        && tail -40 "$f.txt" || tail -5 "$f.progress"
    done
    ;;
  agent-q30)
    # Issue 60 run 2: status line, gaps before the first token, a cut request sent again and
    # a duplicate, per pool (POOLS as serve-q30's; PROMPT tokens, default 16384).
    IFS=';' read -ra pools <<< "${POOLS:-0.25 --host-cache 20G;0.25}"
    for pool in "${pools[@]}"; do
      name=$(echo "$pool" | tr -d ' -' )
      # shellcheck disable=SC2086  # a pool's words are bench agent's arguments
      $py -m moestream.client.cli bench agent --model /root/q30/store --capacity $pool --prompt-tokens ${PROMPT:-16384} \
        --json > "$OUT/bench_agent_q30_${name}_h200.json" 2> "$OUT/bench_agent_q30_${name}_h200.progress" \
        || tail -5 "$OUT/bench_agent_q30_${name}_h200.progress"
    done
    ;;
  chat-q30)
    # Time to the first token of each turn with the prompt cache off and on (issue 28's
    # acceptance: turn 2 onward <= 0.1x the uncached turn), 100% then 25% + a 20G host tier
    # (POOLS="1.0" measures one; pools are separated by ";", as in the default).
    IFS=';' read -ra pools <<< "${POOLS:-1.0;0.25 --host-cache 20G}"
    for pool in "${pools[@]}"; do
      name=$(echo "$pool" | cut -d' ' -f1)
      # shellcheck disable=SC2086  # a pool's words are bench chat's arguments
      $py -m moestream.client.cli bench chat --model /root/q30/store --capacity $pool --turns ${TURNS:-4} \
        --history-tokens ${HISTORY:-2048} --json > "$OUT/bench_chat_q30_${name}_h200.json" \
        2> "$OUT/bench_chat_q30_${name}_h200.progress" || tail -5 "$OUT/bench_chat_q30_${name}_h200.progress"
    done
    ;;
  decode-q30)
    # The acceptance run of issue 6, side by side: stock, 100%, 25% with the host tier on
    # and off and mapped, naive. Sampled at temperature 1 (greedy random models loop). One
    # host tier of 20 GB holds every expert (16.3 GB); so does the mapped pool, with the
    # hottest 25% in GPU memory.
    # Time: with realistic routing (make-q30's EMBED_SCALE=64) the disk-bound runs (25%
    # without the tier, naive) read 0.7-1 GB per token at 1.9 GB/s, and a prefill at 25%
    # reads nearly every expert it routes (a 32-token prompt: about 14 GB), so keep the
    # prompt short. With 32-token prompts and all four capacities the run did not finish
    # in 540 s; this one is estimated at 4-5 min.
    # The host tier holds every expert, so "+host" is made as the daemon makes it: a
    # mapped pool, rebalanced every REBALANCE tokens (short, so that the short runs see
    # it); "+host:slots" is the slot pool with the tier. MAPPED=1 adds "+mapped" runs
    # with MAPPED_MOVES moves per layer per placement turn (the same pool as "+host" at 0).
    # Two untimed rounds by default (WARMUP): a run that timed one caught the pools still
    # warming up (decode/bench_decode_q30_short_h200.json).
    # Each configuration's round decodes again until MIN_ROUND_S seconds of decoding
    # have passed (default 2): a round of 24 tokens at 70 tok/s lasts 0.35 s, and
    # stock's rounds of one run have swung from 50 to 87 tok/s.
    # Then stock and 100% decode in PAIRED_BLOCKS blocks of A B B A (default 24, about
    # 35 s): decode here is bound by the host, whose speed drifts by 1.5x within seconds
    # (probes/full_residency_q30_h200.json), and a block cancels that drift.
    # GEN_LOOP=1 also times each streaming configuration through the daemon's own
    # generation loop (prefetch's auto windows, timed there, once ran the mapped pool at
    # 17-30 tok/s while the bench loop ran it at 27-44).
    # COPY_KERNEL=1: the copier copies with its copy kernel. GATHER=auto|on|off|both: mapped decode steps copy the routed experts into a
    # stack first (auto: on with MLX's CUDA build; both: each mapped configuration both ways).
    # CAPACITIES ("1 0.25") the pools; CONSTRAINED=1 adds structured output's cost per
    # streaming configuration (--constrained); EXTRA more words (--no-naive, --no-stock,
    # --no-slot-pool); TAG names the files of a run of several invocations.
    f="$OUT/bench_decode_q30${TAG:+_$TAG}${COPY_KERNEL:+_kernel}${MLX_MAX_OPS_PER_BUFFER:+_ops$MLX_MAX_OPS_PER_BUFFER}.json"
    ctl bench decode --model /root/q30/store $(for c in ${CAPACITIES:-1 0.25}; do echo --capacity $c; done) \
      ${CONSTRAINED:+--constrained} ${EXTRA:-} \
      --host-cache 20G ${MAPPED:+--mapped} --mapped-gather ${GATHER:-auto} \
      --mapped-rebalance-tokens ${REBALANCE:-32} --temp 1 ${COPY_KERNEL:+--copy-kernel} --warmup-rounds ${WARMUP:-2} \
      --prompt-tokens ${PROMPT_TOKENS:-4} --decode-tokens ${DECODE_TOKENS:-24} --rounds ${ROUNDS:-3} --min-round-seconds ${MIN_ROUND_S:-2} --paired-blocks ${PAIRED_BLOCKS:-24} ${GEN_LOOP:+--generation-loop} --mlx-memory-limit ${MLX_LIMIT:-100G} \
      --json >"$f" 2> >(tee "$f.progress" >&2)
    $py - "$f" <<'EOF'
import json, sys
from moestream.daemon.bench.decode import format_report
print(format_report(json.load(open(sys.argv[1]))))
EOF
    ;;
  gen-demo)
    # The daemon's generation loop against the bench's tight loop on the built-in demo
    # model (7 MB, so host work, not bytes, sets the pace): 100%, 25%, and 25% with a host
    # tier (a mapped pool on an NVIDIA GPU), greedy, so both loops must decode the same tokens.
    f="$OUT/bench_decode_demo_genloop_h200.json"
    ctl bench decode --model daemon/demo/store --capacity 1 --capacity 0.25 --host-cache 64M --no-naive --generation-loop \
      --min-round-seconds 1 --rounds ${ROUNDS:-3} --decode-tokens 64 --prompt-tokens 8 --temp 0 --mlx-memory-limit 16G \
      --json >"$f" 2> >(tee "$f.progress" >&2)
    $py - "$f" <<'EOF'
import json, sys
from moestream.daemon.bench.decode import format_report
print(format_report(json.load(open(sys.argv[1]))))
EOF
    ;;
  optimistic-q30)
    # Issue 55 on the GPU: partial slot pools (no host tier: misses read from the disk)
    # whose decode forwards check residency every few layers, against the same pools with
    # a sync at every layer (":per-layer"), each pair in PAIRED_BLOCKS A B B A blocks
    # (and 100% against stock). Pools near full (CAPACITIES, default 1 0.95 0.8), where
    # the hit rate leaves a token few layers that miss: the miss rule runs the rest on the
    # per-layer path.
    f="$OUT/bench_decode_q30_optimistic${TAG:+_$TAG}.json"
    ctl bench decode --model /root/q30/store $(for c in ${CAPACITIES:-1 0.95 0.8}; do echo --capacity $c; done) \
      --per-layer --no-naive ${EXTRA:-} --temp 1 --warmup-rounds ${WARMUP:-2} \
      --prompt-tokens ${PROMPT_TOKENS:-4} --decode-tokens ${DECODE_TOKENS:-24} --rounds ${ROUNDS:-3} \
      --min-round-seconds ${MIN_ROUND_S:-2} --paired-blocks ${PAIRED_BLOCKS:-12} --mlx-memory-limit ${MLX_LIMIT:-100G} \
      --no-forecast --json >"$f" 2> >(tee "$f.progress" >&2)
    $py - "$f" <<'EOF'
import json, sys
from moestream.daemon.bench.decode import format_report
print(format_report(json.load(open(sys.argv[1]))))
EOF
    ;;
  decode-q30-table)
    # The rest of the table: 50% and 12.5% with the host tier on ("+host": a mapped pool,
    # since it holds every expert; "+host:slots": the slot pool with it) and off. Every
    # configuration stays loaded (about 68 GB of MLX memory with the two mapped pools).
    ctl bench decode --model /root/q30/store --capacity 0.5 --capacity 0.125 --no-naive \
      --host-cache 20G --mapped-rebalance-tokens ${REBALANCE:-32} --temp 1 ${COPY_KERNEL:+--copy-kernel} --warmup-rounds ${WARMUP:-2} \
      --prompt-tokens ${PROMPT_TOKENS:-4} --decode-tokens ${DECODE_TOKENS:-24} --rounds ${ROUNDS:-3} --min-round-seconds ${MIN_ROUND_S:-2} --mlx-memory-limit ${MLX_LIMIT:-96G} \
      --json >"$OUT/bench_decode_q30_table.json" 2> >(tee "$OUT/bench_decode_q30_table.progress" >&2)
    $py - "$OUT/bench_decode_q30_table.json" <<'EOF'
import json, sys
from moestream.daemon.bench.decode import format_report
print(format_report(json.load(open(sys.argv[1]))))
EOF
    ;;
  heat-q30)
    # A daemon at a partial pool counts routings and LRU stack distances (a full pool
    # reads no routing back); REQUESTS (4) requests of TOKENS (128) at temperature 1,
    # one after another; stopping it writes pool_usage.json and pool_reuse.json.
    rt=$(mktemp -d)
    ctl start --model /root/q30/store --capacity 0.25 --host-cache 20G --runtime-dir "$rt"
    for i in $(seq ${REQUESTS:-4}); do
      ctl generate --runtime-dir "$rt" --model /root/q30/store --temp 1 --seed "$i" --max-tokens ${TOKENS:-128} --json \
        "Request $i: write a function that" | $py -c "import json,sys; s=json.load(sys.stdin)['stats']; print({k: s.get(k) for k in ('tokens_per_s', 'hit_rate', 'routed_experts')})"
    done
    ctl stop --runtime-dir "$rt"
    ls -la /root/q30/store | grep pool_ | tee "$OUT/heat_q30.txt"
    # What plan-q30's forecast will read, kept with its figures.
    cp /root/q30/store/pool_usage.json /root/q30/store/pool_reuse.json "$OUT/"
    ;;
  plan-q30)
    # Issue 30's table: the forecast before loading (`bench decode --forecast` plans each
    # configuration with this run's own bandwidths) against the measurement, at 50% and
    # 25%, each without the host tier, with it as a mapped pool ("+host") and as the slot
    # pool's tier ("+host:slots"). The forecast's hit rate comes from the LRU stack
    # distances a daemon recorded while it served the store at a partial pool: run after
    # heat-q30 (a full pool records none).
    # Every decode samples new text (--fresh-text; FRESH=0 repeats one text, whose
    # experts a partial pool keeps, as the runs before it did).
    # HEAT=DIR first copies pool_usage.json and pool_reuse.json from DIR into the store
    # (what an earlier heat-q30 copied to $OUT; make-q30's model is the same each time).
    if [ -n "${HEAT:-}" ]; then cp "$HEAT"/pool_usage.json "$HEAT"/pool_reuse.json /root/q30/store/; fi
    # Time: about 100 s of probes, 80 s of loading and 25 s a round, then the bandwidth
    # probes and the report's forecast: give it 330 s or more (STAGE_TIMEOUT). Each
    # configuration's forecast is also printed once they are loaded, before any round.
    f="$OUT/bench_decode_q30_forecast_h200.json"
    fresh=--fresh-text; [ "${FRESH:-1}" = 0 ] && fresh=
    # Host memory and I/O every 10 s beside it (a run with fresh text once stalled here).
    vmstat -t 10 >"$OUT/plan_q30_vmstat.txt" 2>&1 &
    vm=$!
    ctl bench decode --model /root/q30/store --capacity 0.5 --capacity 0.25 --no-naive --forecast $fresh \
      --host-cache 20G --mapped-rebalance-tokens ${REBALANCE:-32} --temp 1 --warmup-rounds ${WARMUP:-1} \
      --prompt-tokens ${PROMPT_TOKENS:-4} --decode-tokens ${DECODE_TOKENS:-16} --rounds ${ROUNDS:-3} --min-round-seconds ${MIN_ROUND_S:-1} \
      --mlx-memory-limit ${MLX_LIMIT:-96G} --json >"$f" 2> >(tee "$f.progress" >&2)
    $py - "$f" <<'EOF'
import json, sys
from moestream.daemon.bench.decode import format_report
from moestream.daemon.planning.plan import format_decode_forecasts
report = json.load(open(sys.argv[1]))
print(format_report(report))
print(format_decode_forecasts(report["forecast"]))
for row in report["forecast"]:
    print(row["name"], {k: round(v, 2) for k, v in row["forecast_terms_ms"].items()})
for p in report["forecast_pools"]:
    print("pool probe", p)
EOF
    kill $vm
    ;;
  warmstart-q30)
    ctl bench warmstart --model /root/q30/store --capacity 0.25 --tokens 64 --rounds ${ROUNDS:-3} --json >"$OUT/bench_warmstart_q30.json"
    $py - "$OUT/bench_warmstart_q30.json" <<'EOF'
import json, sys
from moestream.daemon.bench.warmstart import format_report
print(format_report(json.load(open(sys.argv[1]))))
EOF
    ;;
  warmstart-q30-host)
    # Both daemons with a host tier that holds every expert; the pinned one fills it
    # from the heat before it is ready.
    ctl bench warmstart --model /root/q30/store --capacity 0.25 --tokens 64 --rounds ${ROUNDS:-2} --host-cache 20G --json >"$OUT/bench_warmstart_q30_host.json"
    $py - "$OUT/bench_warmstart_q30_host.json" <<'EOF'
import json, sys
from moestream.daemon.bench.warmstart import format_report
print(format_report(json.load(open(sys.argv[1]))))
EOF
    ;;
  warmstart-q30-mapped)
    ctl bench warmstart --model /root/q30/store --capacity 0.25 --tokens 64 --rounds ${ROUNDS:-2} --mapped --json >"$OUT/bench_warmstart_q30_mapped.json"
    $py - "$OUT/bench_warmstart_q30_mapped.json" <<'EOF'
import json, sys
from moestream.daemon.bench.warmstart import format_report
print(format_report(json.load(open(sys.argv[1]))))
EOF
    ;;
  elastic-demo)
    # The CUDA copier's row copies and a page-locked tier made again at each size, which the
    # CPU tests do not reach; TOKENS per phase and ROUNDS for the timings.
    $py tests/bench/elastic_probe.py --capacity 0.5 --host-cache 2M --no-mapped --check \
      --tokens ${TOKENS:-128} --rounds ${ROUNDS:-5} --paired ${PAIRED:-16} --json "$OUT/elastic_probe_demo_gpu.json" >"$OUT/elastic_probe_demo_gpu.progress"
    head -c 600 "$OUT/elastic_probe_demo_gpu.progress"; echo
    $py -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in ('shrink_seconds_median','grow_seconds_median','tok_s_median','device')})" \
      "$OUT/elastic_probe_demo_gpu.json"
    ;;
  spec-demo)
    # Speculative decoding with the demo's MTP head against plain decode, K = 1..3.
    ctl bench decode --model daemon/demo/store --speculative mtp $(for k in ${DRAFT:-1 2 3 4}; do echo --draft-tokens $k; done) \
      --capacity 1 --capacity 0.25 --decode-tokens ${DECODE_TOKENS:-128} --rounds ${ROUNDS:-3} --mlx-memory-limit 32G \
      --json >"$OUT/bench_spec_demo_h200.json"
    $py - "$OUT/bench_spec_demo_h200.json" <<'EOF'
import json, sys
from moestream.daemon.bench.speculative import format_speculative_report
print(format_speculative_report(json.load(open(sys.argv[1]))))
EOF
    ;;
  demo)
    # The recipe is outside the package and runs from its parent folder.
    cd tests/bench && $py -m demo_recipe.train --out "$OUT/demo" --minutes "${DEMO_MINUTES:-7}" 2>&1 | tail -40
    ;;
  *)
    echo "unknown stage $stage (bash $0 help lists them)" >&2; exit 2 ;;
esac
