#!/bin/sh
# A study's background loop (docs/study-stress.md, "Running it"): the next cell
# under the heavy-work lock at nice 15, then that cell's files (and the manifest) copied
# into MAIN and committed there under the merge lock, then 20 s for other heavy work to
# take the lock. Polite: before a cell it waits while another heavy job has asked for the
# lock (a file in /tmp/lachesis-heavy-wanted/) and takes the lock only when it is free.
# Stops when the grid is done, when a cell is stopped (SIGTERM, Ctrl-C), or after 6
# crashes of the runner in a row (10 minutes apart); waits while the venv is rebuilt.
#
#   STUDY  a worktree pinned at the study's commit (f7c080d since deviation 1), with .venv:
#          the runs use its code; run this file from MAIN (the pinned copy is older)
#   MAIN   the repository whose checked-out branch gets the results (never anything else)
#   SCRIPT the study's runner (default experiments/stress.py; study 3:
#          experiments/textworld_credit.py), RESULTS its results folder (default
#          experiments/results/stress), NAME the commit messages' prefix (default "stress study")
#
#   STUDY=/work/wt/study2 MAIN=/work/main setsid nohup sh /work/main/experiments/stress_loop.sh \
#       > /work/wt/study-runner.log 2>&1 &
set -u
STUDY=$(cd "${STUDY:?STUDY: the pinned study worktree}" && pwd)
MAIN=$(cd "${MAIN:?MAIN: the repository that gets the results}" && pwd)
LOCK=${LOCK:-/tmp/lachesis-heavy.lock}
MERGE_LOCK=${MERGE_LOCK:-/tmp/lachesis-merge.lock}
R=${RESULTS:-experiments/results/stress}
SCRIPT=${SCRIPT:-experiments/stress.py}
NAME=${NAME:-stress study}
cd "$STUDY" || exit 1
export PYTHONPATH="$STUDY"
echo "$$" > "${PIDFILE:-$STUDY/../study-runner.pid}"
echo "stress loop: pid $$, study $(git rev-parse HEAD) in $STUDY, results to $MAIN ($(date -u +%FT%TZ))"
# a fresh worktree resumes from the cells MAIN has committed
if [ ! -e "$R/manifest.jsonl" ] && [ -e "$MAIN/$R/manifest.jsonl" ]; then
    mkdir -p "$R" && cp -a "$MAIN/$R/." "$R/"
fi
tries=0
while :; do
    # the shared venv may be rebuilt by other work (make install): wait for it
    while [ ! -e .venv/.installed ]; do sleep 60; done
    # polite: wait while other heavy work has asked for the lock; take it only when free
    while :; do
        while [ -n "$(ls -A /tmp/lachesis-heavy-wanted 2>/dev/null)" ]; do sleep 15; done
        flock -n -E 75 "$LOCK" nice -n 15 .venv/bin/python "$SCRIPT" --one
        rc=$?
        [ "$rc" -eq 75 ] || break
        sleep 15
    done
    if [ "$rc" -eq 130 ] || [ "$rc" -eq 143 ]; then
        echo "stress loop: the cell was stopped (exit $rc); stopping ($(date -u +%FT%TZ))"
        exit "$rc"
    fi
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 3 ]; then  # not a failed run (that exits 0): a crash
        tries=$((tries + 1))
        echo "stress loop: $SCRIPT exited $rc (crash $tries of 6 in a row) ($(date -u +%FT%TZ))"
        [ "$tries" -ge 6 ] && { echo "stress loop: stopping"; exit "$rc"; }
        sleep 600
        continue
    fi
    tries=0
    n=$(find "$R" -name summary.json | wc -l)
    flock "$MERGE_LOCK" sh -c "cd '$MAIN' && mkdir -p '$R' && cp -a '$STUDY/$R/.' '$R/' \
        && git add -- '$R' \
        && { git diff --cached --quiet -- '$R' || git commit -q -m '$NAME: $n finished cells' -- '$R'; }" \
        || { echo "stress loop: committing to $MAIN failed; stopping"; exit 1; }
    echo "stress loop: $n finished cells committed ($(date -u +%FT%TZ))"
    [ "$rc" -eq 3 ] && break
    sleep 20
done
echo "stress loop: grid done ($(date -u +%FT%TZ))"
