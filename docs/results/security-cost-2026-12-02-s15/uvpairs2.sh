#!/usr/bin/env bash
cd /tmp/s15
./run1.sh /tmp/s15/wt-base b5-sec; HF_UVLOOP=1 ./run1.sh /tmp/s15/wt-base u5-sec
HF_UVLOOP=1 ./run1.sh /tmp/s15/wt-base u6-sec; ./run1.sh /tmp/s15/wt-base b6-sec
echo done
