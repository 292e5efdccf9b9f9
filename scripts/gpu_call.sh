#!/usr/bin/env bash
# One command of the reference run on a bare GPU machine (python3 with torch, no network), e.g. through the
# device tool, with .whl/ (scripts/gpu_wheels.sh) carried beside the repo:
#
#   bash scripts/gpu_call.sh meta gpu-tests nb-00-01     # full mode: these parts, resumable, past a failed one
#   bash scripts/gpu_call.sh next                        # the parts not done yet, most needed first (reference.PRIORITY)
#   bash scripts/gpu_call.sh --shakedown                 # every notebook in smoke mode on the GPU, past failures
#   FORCE=1 bash scripts/gpu_call.sh nb-09               # redo a part already done (its notebook's code changed since)
#
# It installs the wheels into /tmp/site, runs the parts under a deadline (DEADLINE_S, default 560 s: a device
# command is stopped at 600 s), and after EVERY part packs into $OUT what this command added to the reference
# folder (the files new or changed since it began, with a DELTA.json; the whole folder where it began empty), so a
# command stopped at its limit still returns the parts it finished. An archive that reaches 4 MB is closed and the
# next part goes into the next (<gpu>.part2.tar.gz, ...), so none outgrows the 15 MB a command returns per file.
# $OUT also gets run.log and, for the shakedown, the executed notebooks' archive. Back here: `python -m
# ddpm_core.reference unpack <archive>...` (full mode only; a shakedown's archive is for reading, never for
# data/reference), which puts them over the folder the command carried (give it all of a session's archives: it
# applies them in the order they were made, and keeps the later of two copies of one), then commit
# data/reference/<gpu>/ and figures/.
# The next command (or session) carries the committed folder and goes on from the first part not done.
# The copy of the repo there may hold no .git, or one at another commit: start the command with
# DDPM_GIT_COMMIT=$(git rev-parse HEAD) (its value, written here, after committing) so that meta.json names the
# commit the run measured.
#
# One device command stops at 600 s, but a machine stays warm for a while after it, and a process that started its
# own session (setsid) runs on until the machine goes back. So a session's whole device time can go to one run
# longer than a command, in two back-to-back commands (the second within the machine's warm time):
#
#   bash scripts/gpu_call.sh --detach PART...    # starts the run in its own session (deadline RUN_DEADLINE_S,
#                                                # default 660 s), follows it for ATTACH_S (540 s), copying to $OUT
#   bash scripts/gpu_call.sh --attach            # follows the same run until it ends or ATTACH_S, copying to $OUT
#
# Both copy what the run has packed every 5 s, so a call stopped early still returns every part finished before.
# 660 s: a 15-minute session is ~60-150 s of start, the --detach call (~550 s) and the --attach call; a later
# deadline leaves the --attach call cut off by the session's end after a slow start. --attach, given ATTACH_S (what is
# left of the session, less 30), moves the deadline to ATTACH_MARGIN_S (40 s) before its own end where that is later:
# after a quick start the run gets the seconds a slow one would have needed. Call --attach at once: the machine goes
# back after ~30 s idle, and the detached run with it.
#
# A detached run gives each notebook the run's whole deadline (DDPM_PART_BUDGET_S), for notebooks longer than one
# command (04's max-autotune, 09's compiled stages), and works on a copy of the committed reference folder in
# $BG/reference, outside the repo, which the next command's copy of the working tree would overwrite.
set -uo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
BG=${BG_DIR:-/tmp/gpu_call_bg}
follow() {  # wait for the detached run in $BG to end (or ATTACH_S to pass), copying what it wrote into $OUT as it goes
  local limit=${ATTACH_S:-540} waited=0
  mkdir -p "$OUT"
  while [ ! -f "$BG/exit" ] && [ "$waited" -lt "$limit" ]; do
    sleep 5; waited=$((waited + 5))
    cp -u "$BG"/out/* "$OUT"/ 2>/dev/null  # archives appear whole (written aside, then renamed): never a torn copy
  done
  cp "$BG"/out/* "$OUT"/ 2>/dev/null
  tail -n 30 "$BG/out/run.log" 2>/dev/null
  if [ -f "$BG/exit" ]; then
    echo "gpu_call: the detached run ended (exit $(cat "$BG/exit")); in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
    exit "$(cat "$BG/exit")"
  fi
  echo "gpu_call: the detached run goes on; follow it with 'bash scripts/gpu_call.sh --attach' (in \$OUT so far:" \
       "$(ls "$OUT" | tr '\n' ' '))"
  exit 0
}
if [ "${1:-}" = "--attach" ]; then
  OUT=${OUT:-/tmp/gpu_call_out}
  [ -d "$BG/out" ] || { echo "gpu_call --attach: no detached run on this machine ($BG): it starts bare after being" \
                          "given back, so --attach must follow --detach while the machine is still warm" >&2; exit 4; }
  # An ATTACH_S given here is what is left of the session (its budget_left_s, less 30): the run may go on until
  # ATTACH_MARGIN_S before this command stops following it, in time to pack what it finished (a part cut off too).
  # Only later, never earlier: RUN_DEADLINE_S was set for a session's slowest start, and most starts are quicker.
  if [ -n "${ATTACH_S:-}" ] && [ -f "$BG/deadline" ] && [ ! -f "$BG/exit" ]; then
    was=$(cat "$BG/deadline") now=$(( $(date +%s) + ATTACH_S - ${ATTACH_MARGIN_S:-40} ))
    if [ "$now" -gt "$was" ]; then
      echo "$now" > "$BG/deadline"
      echo "gpu_call: the run's deadline moves $(( now - was )) s later, to $(( ATTACH_S - ${ATTACH_MARGIN_S:-40} )) s from now"
    fi
  fi
  follow
fi
if [ "${1:-}" = "--detach" ]; then
  shift
  [ $# -gt 0 ] || { echo "gpu_call --detach: name the parts to run" >&2; exit 2; }
  OUT=${OUT:-/tmp/gpu_call_out}
  if [ -d "$BG/out" ] && [ ! -f "$BG/exit" ]; then
    echo "gpu_call --detach: a detached run is still going on this machine ($BG): follow it with --attach" >&2
    exit 5
  fi
  rm -rf "$BG" && mkdir -p "$BG/out" "$BG/reference"
  # The run writes its reference folder outside the repo: the next command re-sends the working tree over the
  # repo's copy there, and that must not touch what the run is writing (it reads the committed parts to resume).
  src=${DDPM_REFERENCE_DIR:-data/reference}
  if [ -d "$src" ]; then cp -a "$src"/. "$BG/reference"/; fi
  echo $(( $(date +%s) + ${RUN_DEADLINE_S:-660} )) > "$BG/deadline"  # when the run gets its SIGINT; --attach may move it
  DDPM_REFERENCE_DIR="$BG/reference" OUT="$BG/out" DEADLINE_S=${RUN_DEADLINE_S:-660} DDPM_PART_BUDGET_S=${DDPM_PART_BUDGET_S:-${RUN_DEADLINE_S:-660}} \
    GPU_CALL_DEADLINE_FILE="$BG/deadline" GPU_CALL_BG="$BG" setsid nohup bash -c 'bash "$0" "$@" > "$GPU_CALL_BG/out/console.log" 2>&1; echo $? > "$GPU_CALL_BG/exit"' \
    "$SELF" "$@" < /dev/null > /dev/null 2>&1 &
  echo "gpu_call: detached run of $* started (its log: $BG/out/run.log)"
  follow
fi
if [ $# -eq 0 ]; then  # checked before anything is installed or run
  echo "gpu_call: name the parts to run, e.g. 'bash scripts/gpu_call.sh meta gpu-tests nb-02' (parts: python -m" \
       "ddpm_core.reference run --help), or '--shakedown' for every notebook in smoke mode" >&2
  exit 2
fi
OUT=${OUT:-/tmp/gpu_call_out}
mkdir -p "$OUT"
start=$(date +%s)
WHEELS=${WHEELS:-.whl}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    || { echo "gpu_call: installing $WHEELS/ failed" >&2; exit 3; }
  export PYTHONPATH=/tmp/site:$PWD
else
  echo "gpu_call: no wheels in $WHEELS/: using the machine's own packages (scripts/gpu_wheels.sh makes the wheels)" >&2
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1  # no MPLBACKEND=Agg: the executed notebooks must embed their figures (run_notebook sets inline)
echo "gpu_call: wheels installed in $(( $(date +%s) - start )) s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
df -h /dev/shm 2>&1 | tail -1  # DataLoader workers pass batches through it (07 runs 16): data.check_shared_memory
python3 - <<'PY' || exit 3
import importlib.metadata as md, torch, ddpm_core  # noqa: F401  (fails here, not in the first notebook)
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "MISSING"
print("torch", torch.__version__, "| cuda", torch.cuda.is_available(), "|", " ".join(
    f"{n} {version(n)}" for n in ("numpy", "pandas", "matplotlib", "HolisticTraceAnalysis", "papermill", "ipykernel",
                                  "diffusers", "denoising_diffusion_pytorch", "huggingface_hub", "pytest")))
PY
left=$(( ${DEADLINE_S:-560} - ($(date +%s) - start) ))
if [ "${1:-}" = "--shakedown" ]; then
  shift
  parts=("$@")
  [ ${#parts[@]} -gt 0 ] || parts=(nb-00-01 nb-02 nb-03 nb-03b nb-04 nb-05-06 nb-07 nb-08 nb-09 nb-09b nb-09c nb-10 gpu-tests gpu-tests-slow gpu-tests-autotune)
  shake=${SHAKEDOWN_DIR:-/tmp/shakedown}
  timeout -k 30 -s INT "$left" python3 -m ddpm_core.reference run --smoke --keep-going --out "$shake" \
    --parts "${parts[@]}" 2>&1 | tee "$OUT/run.log"
  rc=${PIPESTATUS[0]}
  # the executed notebooks (with their tracebacks) and parts.json: what a shakedown is read for
  tar -czf "$OUT/shakedown.tar.gz" -C "$(dirname "$shake")" "$(basename "$shake")/parts.json" \
    "$(basename "$shake")/notebooks" $(cd "$(dirname "$shake")" && ls "$(basename "$shake")"/tests*.log 2>/dev/null)
elif [ -n "${GPU_CALL_DEADLINE_FILE:-}" ]; then
  # A detached run: its deadline is a file that --attach may move later (the second command knows how much of the
  # session is left; the first did not). The run reads it before each part (DDPM_RUN_DEADLINE_FILE, 20 s kept for
  # packing), and this loop sends the SIGINT when the file's time comes, as `timeout` does below.
  export DDPM_RUN_DEADLINE_FILE="$GPU_CALL_DEADLINE_FILE"
  python3 -m ddpm_core.reference run --full --keep-going ${FORCE:+--force} --archive-to "$OUT" --parts "$@" \
    > >(tee "$OUT/run.log") 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$(date +%s)" -ge "$(cat "$GPU_CALL_DEADLINE_FILE" 2>/dev/null || echo 0)" ]; then
      echo "gpu_call: the run's deadline: SIGINT (what it finished is packed)"
      kill -INT "$pid" 2>/dev/null
      for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
      kill -KILL "$pid" 2>/dev/null
      break
    fi
    sleep 1
  done
  wait "$pid"
  rc=$?
else
  # the run starts no part whose expected time (reference.part_estimate_s) no longer fits: 20 s are kept for packing
  export DDPM_RUN_DEADLINE=$(( $(date +%s) + left - 20 ))
  # FORCE=1 redoes named parts already done (a notebook changed since it ran: `python -m ddpm_core.reference status`)
  timeout -k 30 -s INT "$left" python3 -m ddpm_core.reference run --full --keep-going ${FORCE:+--force} --archive-to "$OUT" --parts "$@" 2>&1 \
    | tee "$OUT/run.log"
  rc=${PIPESTATUS[0]}
fi
echo "gpu_call: exit $rc after $(( $(date +%s) - start )) s; in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
exit "$rc"
