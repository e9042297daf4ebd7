#!/bin/sh
# ucxtag call 1: UCX 1.13.1 two-sided (tag / stream / am) device->device between two processes on GPU 0.
G=build/gpu-ucxtag
O=${OUT:-/tmp/o}; mkdir -p $O
export LD_LIBRARY_PATH=$PWD/$G/lib:/usr/local/nvidia/lib64:/usr/local/nvidia/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export UCX_WARN_UNUSED_ENV_VARS=n
nvidia-smi -L
port=14000
pt() {  # name tls "extra env" test size iters flags
  port=$((port+1))
  env UCX_TLS=$2 $3 timeout 15 $G/bin/ucx_perftest -t $4 -m cuda,cuda -s $5 -n $6 -w 3 $7 -p $port >$O/srv_$1.log 2>&1 &
  sleep 0.7
  env UCX_TLS=$2 $3 timeout 13 $G/bin/ucx_perftest 127.0.0.1 -t $4 -m cuda,cuda -s $5 -n $6 -w 3 $7 -p $port -f >$O/cli_$1.log 2>&1
  rc=$?; wait
  # final line: iters, lat 50%, avg, overall, BW avg MB/s, BW overall MB/s, msgrate...
  bw=$(grep -E '^ +[0-9]+ ' $O/cli_$1.log | tail -1 | awk '{print $6}')
  echo "$1: $4 $5 B TLS=$2 $3 $7 rc=$rc overall_MBps=$bw"
  [ -n "$bw" ] || grep -E "ERROR|Segm|unreach" $O/cli_$1.log $O/srv_$1.log | head -3
}
S=cuda_ipc,cuda_copy,sm,self
T=cuda_ipc,cuda_copy,tcp,self
pt tag_sm   $S "" tag_bw 67108864 20 ""
pt tag_tcp  $T "" tag_bw 67108864 20 ""
pt tag_tcp_e $T "" tag_bw 67108864 20 "-e"
pt tag_sm_e $S "" tag_bw 67108864 5 "-e"
pt tag_sm_eh $S "UCX_POSIX_ERROR_HANDLING=y UCX_SYSV_ERROR_HANDLING=y" tag_bw 67108864 20 "-e"
pt tag_tcp_e_1m $T "" tag_bw 1048576 200 "-e"
pt tag_tcp_e_4m $T "" tag_bw 4194304 100 "-e"
pt tag_tcp_e_1g $T "" tag_bw 1073741824 5 "-e"
pt stream_sm $S "" stream_bw 67108864 20 ""
pt am_sm $S "" ucp_am_bw 67108864 20 ""
timeout 25 python3 - <<'PY' 2>&1 | tee $O/copy.log
import torch, time
for mb in (4, 64, 1024):
    n = mb << 20
    a = torch.empty(n, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
    for _ in range(3): b.copy_(a)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20): b.copy_(a)
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 20
    print("device copy %5d MiB: %.3f ms, %.0f GB/s (bytes copied)" % (mb, dt * 1e3, n / dt / 1e9))
PY
cd $O && tar czf logs.tgz *.log && rm -f *.log
