"""Kubernetes JobSet manifests for multi-slice TPU jobs and multi-node GPU jobs on GKE.

    python -m launch.jobset --name llama-run --image IMAGE --tpu_type v5p-128 --num_slices 2 \\
        -- configs/base.yml model_name=llama2-7b dcn_data_parallelism=2 > jobset.yaml
    kubectl apply -f jobset.yaml

One replicated job `slice` with one Job per slice (replicas = slices) and one pod per host
(parallelism = completions = hosts per slice). Every pod runs the same trainer command and gets the
environment contract of `maxpar/host/distributed.py`: the coordinator is pod 0 of slice 0 (JobSet gives
pods stable DNS names), the slice id comes from the JobSet job-index annotation, and on TPU GKE adds
TPU_WORKER_HOSTNAMES / TPU_WORKER_ID for the hosts within a slice. On GPU every node is its own
slice (the DCN level across processes), so replicas = nodes and one pod per Job.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from launch.cluster import (TpuSlice, dns_name, hardware_profile, local_output_warning, parse_tpu_type, positive,
                            trainer_command)
from maxpar.core.config import ConfigError
from maxpar.host.distributed import DEFAULT_COORDINATOR_PORT

API_VERSION = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "slice"
CONTAINER = "maxpar"
JOB_INDEX = "metadata.annotations['jobset.sigs.k8s.io/job-index']"
MAX_NAME = 40  # pod names append -slice-J-P-xxxxx and must stay within 63 characters


def contract_env(name: str, num_slices: int) -> list[dict[str, Any]]:
    """The variables every pod reads at start (see maxpar/host/distributed.py)."""
    return [
        {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": f"{name}-{REPLICATED_JOB}-0-0.{name}"},
        {"name": "JAX_COORDINATOR_PORT", "value": str(DEFAULT_COORDINATOR_PORT)},
        {"name": "MEGASCALE_NUM_SLICES", "value": str(num_slices)},
        {"name": "MEGASCALE_SLICE_ID", "valueFrom": {"fieldRef": {"fieldPath": JOB_INDEX}}},
    ]


def _pod_spec(image: str, command: Sequence[str], env: list[dict[str, Any]], resources: dict[str, int],
              node_selector: dict[str, str], priority_class: str, extra: dict[str, Any]) -> dict[str, Any]:
    container = {
        "name": CONTAINER,
        "image": image,
        "command": list(command),
        "env": env,
        "ports": [{"containerPort": DEFAULT_COORDINATOR_PORT, "name": "coordinator"}],
        "resources": {"limits": dict(resources)},
    }
    spec: dict[str, Any] = {"restartPolicy": "Never", "nodeSelector": node_selector, **extra, "containers": [container]}
    if priority_class:
        spec["priorityClassName"] = priority_class
    return spec


def _jobset(name: str, replicas: int, hosts: int, pod_spec: dict[str, Any], max_restarts: int,
            annotations: dict[str, str]) -> dict[str, Any]:
    job = {
        "parallelism": hosts,
        "completions": hosts,
        "completionMode": "Indexed",
        "backoffLimit": 0,  # a failed pod fails its slice; JobSet restarts the whole job (max_restarts)
        "template": {"spec": pod_spec},
    }
    metadata: dict[str, Any] = {"name": name}
    if annotations:
        metadata["annotations"] = annotations
    return {
        "apiVersion": API_VERSION,
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "failurePolicy": {"maxRestarts": max_restarts},
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": replicas, "template": {"spec": job}}],
        },
    }


def tpu_jobset(name: str, image: str, tpu: TpuSlice, num_slices: int, config_args: Sequence[str], *,
               max_restarts: int = 0, priority_class: str = "") -> dict[str, Any]:
    """Multi-slice TPU: one Job per slice, one pod per TPU host, each slice on its own node pool."""
    command = trainer_command(config_args, tpu.chips * num_slices, num_slices, name, hardware_profile(tpu.tpu_type))
    pod = _pod_spec(image, command, contract_env(name, num_slices), {"google.com/tpu": tpu.chips_per_host},
                    {"cloud.google.com/gke-tpu-accelerator": tpu.accelerator,
                     "cloud.google.com/gke-tpu-topology": tpu.topology},
                    priority_class,
                    # Host networking: DCN traffic between slices goes straight over the hosts' NICs.
                    {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
                     "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]})
    # One slice per node pool: the slices of a multi-slice job must be distinct TPU slices.
    exclusive = {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    return _jobset(name, num_slices, tpu.hosts, pod, max_restarts, exclusive)


def gpu_jobset(name: str, image: str, gpu_type: str, gpus_per_node: int, num_nodes: int,
               config_args: Sequence[str], *, max_restarts: int = 0, priority_class: str = "") -> dict[str, Any]:
    """Multi-node GPU: every node is one process and one DCN granule, so one single-pod Job per node."""
    command = trainer_command(config_args, gpus_per_node * num_nodes, num_nodes, name, hardware_profile(gpu_type))
    pod = _pod_spec(image, command, contract_env(name, num_nodes), {"nvidia.com/gpu": gpus_per_node},
                    {"cloud.google.com/gke-accelerator": gpu_type}, priority_class,
                    {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]})
    return _jobset(name, num_nodes, 1, pod, max_restarts, {})


def render(manifest: dict[str, Any]) -> str:
    return yaml.safe_dump(manifest, sort_keys=False, default_flow_style=False)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m launch.jobset", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True, help="JobSet name (lowercase, digits, '-')")
    parser.add_argument("--image", required=True, help="container image with maxpar installed")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--tpu_type", help="TPU type of each slice, e.g. v5p-128, v5litepod-256, v6e-256")
    target.add_argument("--gpu_type", help="GKE accelerator label of the GPU nodes, e.g. nvidia-h100-80gb")
    parser.add_argument("--num_slices", type=int, default=1, help="TPU slices")
    parser.add_argument("--num_nodes", type=int, default=1, help="GPU nodes")
    parser.add_argument("--gpus_per_node", type=int, default=8, help="GPUs per node")
    parser.add_argument("--max_restarts", type=int, default=0, help="JobSet restarts after a failure")
    parser.add_argument("--priority_class", default="", help="pod priorityClassName ('' = none)")
    parser.add_argument("--output", default="-", help="file to write ('-' = stdout)")
    parser.add_argument("config_args", nargs="+", help="after --: CONFIG.yml key=value ...")
    return parser.parse_args(argv)


def manifest_from_args(args: argparse.Namespace) -> dict[str, Any]:
    name = dns_name("name", args.name, MAX_NAME)
    if args.max_restarts < 0:
        raise ConfigError(f"--max_restarts={args.max_restarts}: must be >= 0")
    options = dict(max_restarts=args.max_restarts, priority_class=args.priority_class)
    if args.tpu_type:
        return tpu_jobset(name, args.image, parse_tpu_type(args.tpu_type), positive("num_slices", args.num_slices),
                          args.config_args, **options)
    return gpu_jobset(name, args.image, args.gpu_type, positive("gpus_per_node", args.gpus_per_node),
                      positive("num_nodes", args.num_nodes), args.config_args, **options)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        text = render(manifest_from_args(args))
    except ConfigError as e:
        print(f"launch.jobset: {e}", file=sys.stderr)
        return 2
    warning = local_output_warning(args.config_args)
    if warning:
        print(f"launch.jobset: {warning}", file=sys.stderr)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
