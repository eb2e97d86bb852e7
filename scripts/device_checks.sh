#!/usr/bin/env bash
# Both device checks, one after the other (each at most 5 minutes on a cold GPU machine):
#
#     OUT=/tmp/out bash scripts/device_checks.sh    # logs under $OUT/correctness, $OUT/speed
#
# On a machine lent for less than 10 minutes, run the two scripts as two runs instead:
# scripts/device_check_correctness.sh, then scripts/device_check_speed.sh.
set -u
OUT=${OUT:-/tmp/device_checks}
here=$(dirname "$0")
OUT=$OUT/correctness bash "$here/device_check_correctness.sh"
correctness=$?
OUT=$OUT/speed bash "$here/device_check_speed.sh"
speed=$?
echo "correctness rc=$correctness, speed rc=$speed"
[ "$correctness" -eq 0 ] && [ "$speed" -eq 0 ]
