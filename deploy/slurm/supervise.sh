# shellcheck shell=bash
# The supervise-and-restart loop both batch scripts source (control.sbatch, workers.sbatch): start
# a step, keep its srun pid, reap the steps that ended with their status, count restarts against
# BT_MAX_RESTARTS, and stop every step and wait for them on SIGTERM/SIGINT. What an ended step means
# (start it again, count a finished slot, stop the job) is the sourcing script's: its on_exit hook.
#
# The script defines `say MESSAGE` before sourcing this file, and may define `on_stopped`, run
# once every step has ended as the job stops (control.sbatch drops Redis's files there).

declare -A STEP_LABEL=()  # srun pid -> label (the service's name, or "worker")
declare -A RESTARTS=()    # label -> restarts used
MAX_RESTARTS="${BT_MAX_RESTARTS:-3}"
STOPPING=0

# step_start LABEL SRUN_OPTION... COMMAND...: one task as a step of this job, in the background.
# --exact: only the CPUs the step asks for, so the next one starts beside it; --kill-on-bad-exit=0:
# a step that fails ends alone, not the job (the on_exit hook decides what follows).
step_start() {
    local label=$1
    shift
    srun --ntasks=1 --nodes=1 --exact --kill-on-bad-exit=0 "$@" &
    STEP_LABEL[$!]=$label
    say "started $label (srun pid $!)"
}

# restart_allowed LABEL: true, with one restart counted, while LABEL has restarts left.
restart_allowed() {
    local used=${RESTARTS[$1]:-0}
    [ "$used" -lt "$MAX_RESTARTS" ] || return 1
    RESTARTS[$1]=$((used + 1))
}

steps_running() { echo "${#STEP_LABEL[@]}"; }

# steps_exit CODE: SIGTERM to every step's tasks (each service and worker stops cleanly on it;
# signalling srun itself would kill its step at once), wait for the steps, then exit CODE.
steps_exit() {
    local pid
    STOPPING=1
    trap - TERM INT
    say "stopping"
    scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null
    for pid in "${!STEP_LABEL[@]}"; do wait "$pid" 2>/dev/null; done
    if declare -F on_stopped >/dev/null; then on_stopped; fi
    say "stopped"
    exit "$1"
}

# scancel, or the time limit (--signal=B:TERM@60): Slurm signals the steps too; stop and wait.
trap 'steps_exit 0' TERM INT

# steps_follow ON_EXIT [EACH_ROUND]: until the job stops, `ON_EXIT LABEL STATUS` for each step that
# ended, then EACH_ROUND (a check of the whole), once a second. Polled: `wait -n` would reap a
# step without saying which one, and a trap runs only between commands anyway.
steps_follow() {
    local on_exit=$1 each_round=${2:-:} pid rc label
    while [ "$STOPPING" = 0 ]; do
        for pid in "${!STEP_LABEL[@]}"; do
            kill -0 "$pid" 2>/dev/null && continue
            wait "$pid"
            rc=$?
            label=${STEP_LABEL[$pid]}
            unset "STEP_LABEL[$pid]"
            "$on_exit" "$label" "$rc"
        done
        "$each_round"
        sleep 1
    done
}
