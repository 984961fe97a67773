#!/usr/bin/env bash
# Set up (if needed), lint, type-check and run the test suite. CI runs exactly this.
# With CI=true (or RLSERVE_TEST_VLLM=1) the vLLM tests also run, in their own venv; with
# CI=true (or RLSERVE_TEST_TORCHRL=1) so do the tests beside the real TorchRL library, and (or
# RLSERVE_TEST_TRAINERS=1) the trainers' own clients against the server (tests/trainers); with
# CI=true (or RLSERVE_TEST_DOCKER=1) the images are built and run (scripts/docker-smoke.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
# A deadline for every suite (seconds from now; CI=true: 80 minutes, inside CI's 90): a suite
# still running then is interrupted (pytest prints its summary and the test it was in, and the
# lane's log is printed), so a hang shows where it is instead of the whole run being killed
# silently. RLSERVE_TEST_DEADLINE_S sets another; 0: none.
deadline_s=${RLSERVE_TEST_DEADLINE_S:-$([ "${CI:-}" = "true" ] && echo 4800 || echo 0)}
deadline=$(( deadline_s > 0 ? $(date +%s) + deadline_s : 0 ))
before_deadline() {
  if [ "$deadline" = 0 ]; then "$@"; return; fi
  local left=$(( deadline - $(date +%s) ))
  if [ "$left" -le 0 ]; then echo "not run, past the test deadline: $*" >&2; return 124; fi
  # SIGINT first (pytest reports what ran), SIGKILL a minute later
  timeout --signal=INT --kill-after=60 "$left" "$@" || {
    local status=$?
    if [ "$status" = 124 ] || [ "$status" = 137 ]; then
      echo "stopped at the test deadline (${deadline_s} s after the start): $*" >&2
    fi
    return "$status"
  }
}
./scripts/setup.sh
extras=()
if [ "${CI:-}" = "true" ] || [ "${RLSERVE_TEST_TORCHRL:-0}" = "1" ]; then extras+=(torchrl); fi
if [ "${CI:-}" = "true" ] || [ "${RLSERVE_TEST_VLLM:-0}" = "1" ]; then extras+=(vllm); fi
if [ "${CI:-}" = "true" ] || [ "${RLSERVE_TEST_TRAINERS:-0}" = "1" ]; then extras+=(trainers); fi
# Their venvs build in the background, side by side with each other and the checks below
# (one pip uses one core); each suite waits for its own venv only, so the main suite starts
# as soon as the checks pass (the slowest venv takes minutes longer).
setups=$(mktemp -d)
# (On exit: a build still running is stopped. `set -e` holds in the trap too, hence || true.)
trap 'jobs -p | xargs -r kill 2>/dev/null || true; rm -rf "$setups"' EXIT
for name in "${extras[@]}"; do
  (
    status=0
    "./scripts/setup-$name.sh" > "$setups/$name.log" 2>&1 || status=$?
    echo "$status" > "$setups/$name.rc"
  ) &
done
# The Docker smoke test (tests/docker/test_smoke.py) needs an engine and Compose v2: CI
# installs them from Debian (the test skips, saying why, where they are missing).
if [ "${CI:-}" = "true" ] || [ "${RLSERVE_TEST_DOCKER:-0}" = "1" ]; then
  if [ "$(id -u)" = "0" ]; then
    ./scripts/docker-deps.sh || echo "note: docker-deps failed; the Docker smoke test will skip" >&2
  fi
  # The image's build mostly waits on package downloads: it runs beside the linters and the
  # venv builds, and the smoke test checks this run (its status in the report's path + .rc).
  if docker compose version > /dev/null 2>&1 && \
    { docker info > /dev/null 2>&1 || { [ "$(id -u)" = "0" ] && command -v dockerd > /dev/null; }; }; then
    export RLSERVE_DOCKER_SMOKE_REPORT="$setups/docker-smoke.json"
    (
      status=0
      ./scripts/docker-smoke.sh --json "$RLSERVE_DOCKER_SMOKE_REPORT" \
        > "$RLSERVE_DOCKER_SMOKE_REPORT.log" 2>&1 || status=$?
      echo "$status" > "$RLSERVE_DOCKER_SMOKE_REPORT.rc"
    ) &
  fi
fi
./scripts/lint.sh
./scripts/check-docker.sh
# The extra suites run one after another beside the main one: the main suite keeps about
# three quarters of one core busy (much of it waits on servers it started), so the second core
# takes them. Their output follows the main suite's; every suite runs whatever the others do.
# When the whole suite runs (no arguments), the longest tests (marked `beside`: benchmark
# smokes and the install script, about 7 minutes) go first in that lane too, which keeps the
# two lanes about equal.
extra_status=0
main_args=("$@")
# Torch starts a thread a core in every process; with a suite in each lane, the cores are
# oversubscribed and torch's threads wait on each other: the benchmark smokes ran slower
# (bench/learning.py --quick beside the main suite: 452 s with two threads in an earlier run;
# 171 s and 236 s with one in two clean-clone rehearsals). So while two lanes run, the main
# suite and the long tests take one thread a torch process (OMP_NUM_THREADS, unless it is
# set). The extra suites keep their own settings (vLLM binds its threads itself).
threads=()
if [ "${#extras[@]}" -gt 0 ]; then
  threads=(env "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}")
  beside=0
  if [ "$#" -eq 0 ]; then
    beside=1
    main_args=(-m "not beside")
  fi
  (
    status=0
    if [ "$beside" = 1 ]; then
      echo "=== long tests (main venv) ==="
      before_deadline "${threads[@]}" .venv/bin/python -m pytest -m beside tests/bench \
        tests/docker --durations=5 || status=1
    fi
    for name in "${extras[@]}"; do
      echo "=== $name suite ==="
      while [ ! -f "$setups/$name.rc" ]; do
        if [ "$deadline" != 0 ] && [ "$(date +%s)" -ge "$deadline" ]; then
          echo "past the test deadline" > "$setups/$name.rc"
          break
        fi
        sleep 5
      done
      cat "$setups/$name.log"
      if [ "$(cat "$setups/$name.rc")" != 0 ]; then
        echo "setting up the $name venv failed"
        status=1
        continue
      fi
      before_deadline "./scripts/test-$name.sh" || status=1
    done
    exit "$status"
  ) > "$setups/extras.log" 2>&1 &
  extras_pid=$!
fi
# (the slowest tests are listed at the end: where CI time goes)
main_status=0
before_deadline "${threads[@]}" .venv/bin/python -m pytest --durations=25 "${main_args[@]}" \
  || main_status=$?
if [ "${#extras[@]}" -gt 0 ]; then
  wait "$extras_pid" || extra_status=$?
  cat "$setups/extras.log"
fi
if [ "$main_status" -ne 0 ] || [ "$extra_status" -ne 0 ]; then
  echo "failed: main suite exit $main_status, extra suites exit $extra_status" >&2
  exit 1
fi
