#!/usr/bin/env bash
cd /tmp/s15
HF_UVLOOP=1 ./run1.sh /tmp/s15/wt-base u2-sec; ./run1.sh /tmp/s15/wt-base b3-sec
./run1.sh /tmp/s15/wt-base b4-sec; HF_UVLOOP=1 ./run1.sh /tmp/s15/wt-base u4-sec
echo done
