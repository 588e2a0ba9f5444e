"""The `xpk workload create` command for a multi-slice TPU job, printed (--dry-run) or run.

    python -m launch.xpk --cluster my-cluster --workload llama-run --tpu_type v5p-128 --num_slices 2 \\
        --docker_image gcr.io/PROJECT/maxpar:latest --priority high --max_restarts 3 --dry-run \\
        -- configs/base.yml model_name=llama2-7b dcn_data_parallelism=2

XPK wraps the command in a JobSet with one Job per slice; GKE gives every pod the environment that
`maxpar/host/distributed.py` reads (MEGASCALE_* across slices, TPU_WORKER_* within one), so the trainer
joins the job with no further flags. The config is checked against the slices before anything runs.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence

from launch.cluster import dns_name, hardware_profile, local_output_warning, parse_tpu_type, positive, trainer_command
from maxpar.core.config import ConfigError

PRIORITIES = ("very-low", "low", "medium", "high", "very-high")
MAX_WORKLOAD_NAME = 40


def xpk_command(*, cluster: str, workload: str, tpu_type: str, num_slices: int, docker_image: str,
                config_args: Sequence[str], priority: str = "medium", max_restarts: int = 0,
                project: str = "", zone: str = "") -> list[str]:
    """argv of `xpk workload create` running the trainer with `config_args` on every host of every slice."""
    dns_name("workload", workload, MAX_WORKLOAD_NAME)
    if priority not in PRIORITIES:
        raise ConfigError(f"--priority={priority!r}: must be one of {', '.join(PRIORITIES)}")
    if max_restarts < 0:
        raise ConfigError(f"--max_restarts={max_restarts}: must be >= 0")
    tpu = parse_tpu_type(tpu_type)
    command = trainer_command(config_args, tpu.chips * positive("num_slices", num_slices), num_slices, workload,
                              hardware_profile(tpu_type))
    argv = ["xpk", "workload", "create", "--cluster", cluster, "--workload", workload, "--tpu-type", tpu_type,
            "--num-slices", str(num_slices), "--docker-image", docker_image, "--priority", priority,
            "--max-restarts", str(max_restarts), "--command", shlex.join(command)]
    if project:
        argv += ["--project", project]
    if zone:
        argv += ["--zone", zone]
    return argv


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m launch.xpk", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", required=True, help="XPK/GKE cluster name")
    parser.add_argument("--workload", required=True, help="workload name (lowercase, digits, '-')")
    parser.add_argument("--tpu_type", required=True, help="TPU type of each slice, e.g. v5p-128")
    parser.add_argument("--num_slices", type=int, default=1, help="number of slices (the DCN level)")
    parser.add_argument("--docker_image", required=True, help="image with maxpar installed")
    parser.add_argument("--priority", default="medium", help=f"one of {', '.join(PRIORITIES)}")
    parser.add_argument("--max_restarts", type=int, default=0, help="JobSet restarts after a failure")
    parser.add_argument("--project", default="", help="GCP project ('' = gcloud's default)")
    parser.add_argument("--zone", default="", help="GCP zone ('' = gcloud's default)")
    parser.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true",
                        help="print the command instead of running it")
    parser.add_argument("config_args", nargs="+", help="after --: CONFIG.yml key=value ...")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        command = xpk_command(cluster=args.cluster, workload=args.workload, tpu_type=args.tpu_type,
                              num_slices=args.num_slices, docker_image=args.docker_image,
                              config_args=args.config_args, priority=args.priority,
                              max_restarts=args.max_restarts, project=args.project, zone=args.zone)
    except ConfigError as e:
        print(f"launch.xpk: {e}", file=sys.stderr)
        return 2
    warning = local_output_warning(args.config_args)
    if warning:
        print(f"launch.xpk: {warning}", file=sys.stderr)
    if args.dry_run:
        print(shlex.join(command))
        return 0
    if shutil.which("xpk") is None:
        print("launch.xpk: xpk is not installed (pip install xpk); --dry-run prints the command instead",
              file=sys.stderr)
        return 1
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
