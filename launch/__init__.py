"""Launching maxpar jobs: `launch.local` (N processes on this machine), `launch.xpk` (the `xpk workload
create` command for multi-slice TPU jobs) and `launch.jobset` (Kubernetes JobSet manifests for TPU or GPU).

All of them hand every process the same environment contract, read by `maxpar/host/distributed.py`.
"""
