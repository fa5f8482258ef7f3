#!/bin/bash
# device call 3 (warm): make test-gpu-sanitize's three tools on the build of call 1, in parallel
T0=$(date +%s)
ls build/test_gpu || exit 3
for tool in memcheck racecheck synccheck; do
  (BNB8_TEST_QUICK=1 timeout 560 compute-sanitizer --tool $tool --error-exitcode 1 ./build/test_gpu > $OUT/san_$tool.log 2>&1; echo "rc=$? after $(( $(date +%s) - T0 )) s" >> $OUT/san_$tool.log) &
done
wait
for tool in memcheck racecheck synccheck; do echo "== $tool"; grep -E "^ok|^FAIL|passed|ERROR SUMMARY|HAZARD|rc=" $OUT/san_$tool.log | cut -c1-150; done
