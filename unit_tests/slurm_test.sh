#!/usr/bin/env bash
# shellcheck disable=SC2016,SC2034  # check() takes its test in single quotes and evaluates it
# A one-node Slurm cluster inside a test (Debian's slurmctld + slurmd in the
# foreground, a generated slurm.conf in a temporary folder, auth/none, no
# cgroups), and `ash train` on 2 ranks submitted with sbatch through
# perf_tests/cluster/train.sbatch:
#   1. scancel --signal=USR1: every rank stops after the same step, one
#      checkpoint (the last step logged), exit 138; resubmitting the same
#      script resumes it, and the result is bitwise the result of one
#      uninterrupted run (parameters, Adam moments, losses);
#   2. plain scancel (SIGTERM to every rank, twice: from slurmstepd and
#      through srun): exit 143 with a checkpoint;
#   3. #SBATCH --signal=USR1@30 with --time=1: Slurm's own warning stops it;
#   4. the time limit itself (--time=1, no --signal: SIGTERM at the limit):
#      a checkpoint at the last step logged, which resumes.
#   bash unit_tests/slurm_test.sh --ash build/src/ash [--python PY] [--workdir DIR]
# Exit 0: passed; 77: skipped (no Slurm and no way to install it, or the
# daemons cannot run here; the reason is printed); anything else: failed.
# Installs slurmctld, slurmd and slurm-client with apt-get when they are
# missing and this is root or passwordless sudo (ASH_SLURM_INSTALL=0: never).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ASH="" PY="" WORK=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ash) ASH=$(realpath "$2"); shift 2 ;; --python) PY=$2; shift 2 ;; --workdir) WORK=$2; shift 2 ;;
    *) echo "slurm_test.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -x "$ASH" ] || { echo "slurm_test.sh: --ash must name the ash binary" >&2; exit 2; }
t_start=$SECONDS
say() { echo "[slurm_test $((SECONDS - t_start))s] $*"; }
skip() { say "SKIP: $*"; exit 77; }
failed=0
fail() { say "FAIL: $*"; failed=1; }
check() { if eval "$1"; then say "ok: $2"; else fail "$2 ($1)"; fi; }

# ---- Slurm present, or installed ---------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null; then
  SUDO=()
  [ "$(id -u)" -ne 0 ] && SUDO=(sudo -n)
  if [ "${ASH_SLURM_INSTALL:-1}" != 1 ] || ! command -v apt-get >/dev/null || { [ ${#SUDO[@]} -gt 0 ] && ! sudo -n true 2>/dev/null; }; then
    skip "slurmctld, slurmd or sbatch missing (apt-get install slurmctld slurmd slurm-client, as root)"
  fi
  say "installing slurmctld slurmd slurm-client (Debian)"
  inst() { timeout 300 "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
             slurmctld slurmd slurm-client >/dev/null 2>&1; }
  inst || { timeout 300 "${SUDO[@]}" apt-get update -qq >/dev/null 2>&1; inst; } || skip "apt-get install slurmctld slurmd slurm-client failed"
fi

# ---- the cluster -------------------------------------------------------------
[ -n "$WORK" ] || WORK=$(mktemp -d)
mkdir -p "$WORK"
dir=$(mktemp -d "$(realpath "$WORK")/slurm.XXXXXX")
conf="$dir/slurm.conf"
export SLURM_CONF="$conf"
pids=()
cleanup() {
  trap - EXIT INT TERM
  [ -n "${watchdog:-}" ] && kill "$watchdog" 2>/dev/null
  timeout 10 scancel --full --signal=KILL --user="$(id -un)" >/dev/null 2>&1
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.5
  done
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  # Left-over step daemons and ranks of this cluster (their environment names our slurm.conf).
  for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    [ "$pid" = $$ ] && continue
    grep -qzF "SLURM_CONF=$conf" "$p/environ" 2>/dev/null && kill -9 "$pid" 2>/dev/null
  done
  [ "${KEEP:-0}" = 1 ] || rm -rf "$dir"
}
trap cleanup EXIT
trap 'say "FAIL: interrupted or out of time"; exit 1' INT TERM
( sleep 270; kill -TERM $$ ) 2>/dev/null &  # never hang: ctest's TIMEOUT is 300 s
watchdog=$!

free_port() {  # two free TCP ports in a row, at random
  local p
  for _ in $(seq 50); do
    p=$((20000 + RANDOM % 30000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null && ! (exec 3<>"/dev/tcp/127.0.0.1/$((p + 1))") 2>/dev/null; then
      echo "$p"; return
    fi
  done
  echo 26817
}
port=$(free_port)
me=$(id -un)
mkdir -p "$dir/state" "$dir/spool"
cat > "$conf" <<EOF
ClusterName=ashtest
SlurmctldHost=localhost
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/none
CredType=cred/none
SlurmUser=$me
SlurmdUser=$me
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=30
SlurmdParameters=config_overrides
NodeName=localhost CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
slurmctld -D -i -f "$conf" > "$dir/slurmctld.log" 2>&1 &
pids+=($!)
slurmd -D -N localhost -f "$conf" > "$dir/slurmd.log" 2>&1 &
pids+=($!)
for _ in $(seq 60); do
  [ "$(timeout 5 sinfo -h -o %T 2>/dev/null)" = idle ] && break
  sleep 0.5
done
if [ "$(timeout 5 sinfo -h -o %T 2>/dev/null)" != idle ]; then
  say "the daemons' last lines:"; tail -n 8 "$dir/slurmctld.log" "$dir/slurmd.log"
  skip "a one-node Slurm cluster did not come up here within 30 s (logs above)"
fi
say "cluster up: $(slurmctld -V), port $port, $dir"

# ---- jobs --------------------------------------------------------------------
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
text="$dir/text.txt"
for i in $(seq 400); do echo "the quick brown fox $i jumps over the lazy dog; a stitch in time saves nine."; done > "$text"
tiny="--set data.train=$text --set model.width=8 --set model.state=4 --set model.layers=2 --set data.seq_len=24 \
--set optim.steps=100000000 --set run.log_every=100000000 --set run.ckpt_every=0 --set run.eval_every=0"
medium="--set data.train=$text --set model.width=64 --set model.state=16 --set model.layers=2 --set data.seq_len=2048 \
--set optim.steps=100000000 --set run.log_every=1 --set run.ckpt_every=0 --set run.eval_every=0"
layout="--set dist.layer_ranks=2"
# submit NAME RUN_DIR ASH_ARGS [sbatch options]: train.sbatch on 2 ranks; prints the job id.
submit() {
  local name=$1 run=$2 args=$3
  shift 3
  ASH_ROOT="$ROOT" ASH="$ASH" CONFIG="" RUN_DIR="$run" LAYOUT="$layout" ASH_ARGS="$args" \
    timeout 20 sbatch --parsable --job-name="$name" --nodes=1 --ntasks=2 --ntasks-per-node=2 --time=5 \
    --output="$dir/$name-%j.out" "$@" "$ROOT/perf_tests/cluster/train.sbatch"
}
steps_logged() { [ -f "$1/metrics.jsonl" ] && wc -l < "$1/metrics.jsonl" || echo 0; }
wait_steps() {  # RUN_DIR N SECONDS
  for _ in $(seq $(($3 * 5))); do [ "$(steps_logged "$1")" -ge "$2" ] && return 0; sleep 0.2; done
  return 1
}
job_field() { timeout 5 scontrol show job "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -1; }
wait_job() {  # JOB SECONDS: until it has ended
  for _ in $(seq $(($2 * 2))); do
    case "$(job_field "$1" JobState)" in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|"") return 0 ;; esac
    sleep 0.5
  done
  return 1
}
ckpt_step() { "$ASH" inspect "$1" 2>/dev/null | sed -n 's/.*, step \([0-9]*\),.*/\1/p'; }
interrupts() { grep -c "interrupted by $2 after step" "$1" 2>/dev/null; }

# 4 starts first: its limit comes after a minute, while the others run.
tl_run="$dir/run-timelimit"
tl=$(timeout 20 sbatch --parsable --job-name=timelimit -n 2 --time=1 --output="$dir/timelimit-%j.out" \
     --wrap="srun --mpi=pmix $ASH train $medium $layout --set run.out_dir=$tl_run")
say "job $tl: SIGTERM at its time limit (--time=1)"

# 1. scancel --signal=USR1, resume, compare with an uninterrupted run.
a_run="$dir/run-usr1"
a=$(submit usr1 "$a_run" "$tiny")
wait_steps "$a_run" 3 60 || fail "job $a logged no steps in 60 s"
timeout 10 scancel --signal=USR1 "$a"
wait_job "$a" 60 || fail "job $a did not end within 60 s of SIGUSR1"
a_out="$dir/usr1-$a.out"
k=$(steps_logged "$a_run")
check '[ "$(job_field "$a" ExitCode)" = "138:0" ]' "scancel --signal=USR1: job $a exit 138 ($(job_field "$a" JobState) $(job_field "$a" ExitCode))"
check '[ "$(interrupts "$a_out" SIGUSR1)" = 1 ]' "one 'interrupted by SIGUSR1 after step' line"
check '[ "$(ckpt_step "$a_run/checkpoint.h5")" = "$k" ]' "the checkpoint is the last step logged ($k)"
until_step=$((k + 10))
r_run="$dir/run-reference"
a2=$(submit resume "$a_run" "$tiny --until $until_step")
r=$(submit reference "$r_run" "$tiny --until $until_step")
{ wait_job "$a2" 90 && wait_job "$r" 90; } || fail "resume $a2 / reference $r did not end in 90 s"
check 'grep -q "resuming from $a_run/checkpoint.h5" "$dir/resume-$a2.out"' "resubmitting train.sbatch resumes from the run folder's checkpoint"
check '[ "$(job_field "$a2" ExitCode)" = 0:0 ] && [ "$(job_field "$r" ExitCode)" = 0:0 ]' "resumed and uninterrupted runs to step $until_step exit 0"
check '[ "$(ckpt_step "$a_run/checkpoint.h5")" = $until_step ] && [ "$(ckpt_step "$r_run/checkpoint.h5")" = $until_step ]' "both checkpoints at step $until_step"
losses() { sed -E 's/,?"(step_s|train_s|tokens_per_s|peak_bytes|hwm_bytes|val_loss|val_bits_per_token)":[^,}]*//g' "$1/metrics.jsonl"; }
check 'cmp -s <(losses "$a_run") <(losses "$r_run")' "losses, learning rates and gradient norms of steps 1..$until_step are identical"
if [ -n "$PY" ] && "$PY" -c "import h5py, numpy" 2>/dev/null; then
  cat > "$dir/compare.py" <<"EOF"
import sys, h5py
a, b = h5py.File(sys.argv[1], "r"), h5py.File(sys.argv[2], "r")
names = []
a.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
bad = [n for n in names if n not in b or a[n][()].tobytes() != b[n][()].tobytes()]
bad += [k for k in ("step", "data_cursor", "rng_state") if a.attrs[k].tobytes() != b.attrs[k].tobytes()]
print(f"{len(names)} datasets compared, differing: {bad}")
sys.exit(1 if bad or not names else 0)
EOF
  check '"$PY" "$dir/compare.py" "$a_run/checkpoint.h5" "$r_run/checkpoint.h5"' \
    "stopped-and-resumed checkpoint is bitwise the uninterrupted one (parameters, Adam moments, step, cursor, RNG)"
else
  say "no Python with h5py (--python): checkpoints not compared dataset by dataset"
fi

# 2. plain scancel: SIGTERM to every rank, twice (slurmstepd, and srun forwarding its own).
b_run="$dir/run-term"
b=$(submit term "$b_run" "$medium")
wait_steps "$b_run" 2 60 || fail "job $b logged no steps in 60 s"
timeout 10 scancel "$b"
wait_job "$b" 60 || fail "job $b did not end within 60 s of scancel"
check 'grep -q "Exited with exit code 143" "$dir/term-$b.out"' "scancel: the ranks exit 143"
check '[ "$(interrupts "$dir/term-$b.out" SIGTERM)" = 1 ]' "one 'interrupted by SIGTERM after step' line"
check '[ "$(ckpt_step "$b_run/checkpoint.h5")" = "$(steps_logged "$b_run")" ]' "the checkpoint is the last step logged ($(steps_logged "$b_run"))"

# 3. Slurm's warning before the time limit, asked for with --signal.
c_run="$dir/run-signal"
c=$(submit signal "$c_run" "$tiny" --time=1 --signal=USR1@30)
say "job $c: --time=1 --signal=USR1@30"
wait_job "$c" 100 || fail "job $c did not end in 100 s"
check '[ "$(job_field "$c" ExitCode)" = "138:0" ] && [ "$(interrupts "$dir/signal-$c.out" SIGUSR1)" = 1 ]' "--signal=USR1@30: exit 138 after one interrupted line"
check '[ "$(ckpt_step "$c_run/checkpoint.h5")" = "$(steps_logged "$c_run")" ]' "the checkpoint is the last step logged ($(steps_logged "$c_run"))"

# 4. the time limit.
wait_job "$tl" 150 || fail "job $tl did not end in 150 s"
tl_out="$dir/timelimit-$tl.out"
check 'grep -q "DUE TO TIME LIMIT" "$tl_out"' "job $tl reached its time limit ($(job_field "$tl" JobState))"
check '[ "$(interrupts "$tl_out" SIGTERM)" = 1 ] && grep -q "Exited with exit code 143" "$tl_out"' "SIGTERM at the limit: one interrupted line, ranks exit 143"
n=$(steps_logged "$tl_run")
check '[ "$(ckpt_step "$tl_run/checkpoint.h5")" = "$n" ]' "the checkpoint is the last step logged ($n)"
check 'timeout 120 srun -n 2 --mpi=pmix "$ASH" train --resume "$tl_run/checkpoint.h5" $layout --until $((n + 1)) >"$dir/tl-resume.out" 2>&1' "it resumes (srun, to step $((n + 1)))"

if [ $failed != 0 ]; then
  for f in "$dir"/*.out; do echo "== $f"; tail -n 15 "$f"; done
  say "FAILED"; exit 1
fi
say "passed"
