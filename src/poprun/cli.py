"""The ``poprun`` command: runs a program the way Graphcore's PopRun did, on torchrun.

``poprun --num-instances 2 --num-replicas 4 --ipus-per-replica 1 python train.py``
starts ``torchrun --standalone --nproc-per-node 2 --no-python python train.py`` with
the replica counts in the environment that :py:mod:`popdist` reads. IPU-only flags are
accepted and reported once as having no effect here; a launch over several hosts
prints the torchrun command to run on each host instead (torchrun is started on every
host, PopRun started them all over SSH from one).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass, field

TOTAL_REPLICAS_ENV = "POPDIST_NUM_TOTAL_REPLICAS"
IPUS_PER_REPLICA_ENV = "POPDIST_NUM_IPUS_PER_REPLICA"
RDZV_PORT = 29400
_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}

# PopRun flags that only concern IPU systems (V-IPU partitions, IPU-Link domains, NUMA
# placement next to IPUs, MPI's transport): accepted, no effect here.
_IPU_ONLY_FLAGS = [
    ("--vipu-server-host", str, "V-IPU server: there are no IPU partitions to create"),
    ("--vipu-server-port", int, "V-IPU server port"),
    ("--vipu-server-timeout", int, "V-IPU server timeout"),
    ("--vipu-partition", str, "IPU partition name"),
    ("--vipu-cluster", str, "IPU cluster name"),
    ("--vipu-allocation", str, "V-IPU allocation"),
    ("--num-ilds", int, "IPU-Link domains"),
    ("--ipus-per-server", int, "IPUs per server"),
    ("--sync-type", str, "IPU sync configuration"),
    ("--mpi-global-args", str, "arguments for mpirun (torchrun is used instead; "
                               "'-x NAME[=VALUE]' exports are honoured)"),
    ("--mpi-local-args", str, "arguments for mpirun's processes ('-x NAME[=VALUE]' "
                              "exports are honoured)"),
]
_IPU_ONLY_SWITCHES = [
    ("--numa-aware", "NUMA placement next to the IPUs (torchrun's --numa-binding=node "
                     "places processes on NUMA nodes, if you want that)"),
    ("--reset-partition", "IPU partition reset"),
    ("--update-partition", "IPU partition update"),
    ("--remove-partition", "IPU partition removal"),
    ("--print-topology", "IPU topology printout"),
    ("--offline-mode", "offline compilation without IPUs"),
]

EPILOG = f"""\
how PopRun's flags map to torchrun:
  --num-instances N         torchrun --nproc-per-node N (one host), one process per
                            instance; popdist.getNumInstances() == N
  --num-replicas R          {TOTAL_REPLICAS_ENV}=R for popdist: each instance runs
                            R / N replicas (popdist.getNumLocalReplicas(),
                            popdist.poptorch.Options' replicationFactor)
  --ipus-per-replica K      {IPUS_PER_REPLICA_ENV}=K (popdist.getNumIpusPerReplica())
  --host h1,h2,...          one host (or localhost): runs here; several: prints the
                            torchrun command for each host (--nnodes, --node-rank,
                            c10d rendezvous on h1:{RDZV_PORT}) and exits
  --only-output-from-instance I   torchrun --local-ranks-filter I
  --tag-output              torchrun --tee 3 (each line prefixed with its rank)
  --executable-cache-path D POPTORCH_CACHE_DIR=D
  -x NAME[=VALUE], --mpi-*-args '-x NAME[=VALUE]'   exported to every instance
  --print-torchrun          (ours) print the torchrun command instead of running it
no effect here (accepted, reported once): {", ".join(
    [f for f, _, _ in _IPU_ONLY_FLAGS] + [f for f, _ in _IPU_ONLY_SWITCHES])}
"""


class PoprunError(Exception):
    """A poprun command line that cannot be run."""


@dataclass
class Plan:
    """What ``poprun`` runs: one command per host and the environment it adds."""
    commands: list[list[str]]
    env: dict[str, str]
    hosts: list[str]
    ignored: list[str] = field(default_factory=list)

    @property
    def runs_here(self) -> bool:
        return len(self.hosts) == 1 and self.hosts[0] in _LOCAL_HOSTS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="poprun", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a PopTorch program over several instances, as PopRun did, on "
                    "torchrun (OpenPopTorch).", epilog=EPILOG)
    parser.add_argument("--num-instances", type=int, default=1,
                        help="processes (instances) in all (default 1)")
    parser.add_argument("--num-replicas", type=int, required=True,
                        help="replicas of all instances together")
    parser.add_argument("--ipus-per-replica", type=int, default=1,
                        help="IPUs (stages) per replica (default 1)")
    parser.add_argument("-H", "--host", type=str, default=None,
                        help="comma-separated hosts (default: this one)")
    parser.add_argument("--only-output-from-instance", type=int, default=None)
    parser.add_argument("--tag-output", action="store_true")
    parser.add_argument("--executable-cache-path", type=str, default=None)
    parser.add_argument("-x", dest="exports", action="append", default=[],
                        metavar="NAME[=VALUE]", help="export an environment variable")
    parser.add_argument("--print-torchrun", action="store_true",
                        help="print the torchrun command(s) and exit")
    for flag, kind, what in _IPU_ONLY_FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=f"no effect: {what}")
    for flag, what in _IPU_ONLY_SWITCHES:
        parser.add_argument(flag, action="store_true", help=f"no effect: {what}")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("program", nargs=argparse.REMAINDER,
                        help="the program and its arguments (python train.py ...)")
    return parser


def _exports(values: list[str], mpi_args: list[str | None]) -> dict[str, str]:
    """``-x NAME=VALUE`` / ``-x NAME`` (the current value), as mpirun read them."""
    names = list(values)
    for text in mpi_args:
        if not text:
            continue
        words = shlex.split(text)
        names += [words[i + 1] for i, w in enumerate(words[:-1]) if w == "-x"]
    env = {}
    for item in names:
        name, eq, value = item.partition("=")
        if not name:
            raise PoprunError(f"poprun: -x {item!r}: expected NAME or NAME=VALUE.")
        if eq:
            env[name] = value
        elif name in os.environ:
            env[name] = os.environ[name]
    return env


def build_plan(argv: list[str]) -> Plan:
    """Parse a poprun command line into the torchrun command(s) and environment."""
    args = _parser().parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        raise PoprunError("poprun: no program given: poprun [options] python train.py "
                          "[arguments]")
    for name in ("num_instances", "num_replicas", "ipus_per_replica"):
        if getattr(args, name) < 1:
            raise PoprunError(f"poprun: --{name.replace('_', '-')} must be >= 1, got "
                              f"{getattr(args, name)}.")
    if args.num_replicas % args.num_instances:
        raise PoprunError(
            f"poprun: --num-replicas {args.num_replicas} is not a multiple of "
            f"--num-instances {args.num_instances}: every instance runs the same number "
            "of replicas.")
    hosts = [h.strip() for h in (args.host or "localhost").split(",") if h.strip()]
    if args.num_instances % len(hosts):
        raise PoprunError(f"poprun: --num-instances {args.num_instances} cannot be spread "
                          f"evenly over {len(hosts)} hosts.")
    per_host = args.num_instances // len(hosts)
    if args.only_output_from_instance is not None and not \
            0 <= args.only_output_from_instance < args.num_instances:
        raise PoprunError(f"poprun: --only-output-from-instance "
                          f"{args.only_output_from_instance} is not an instance "
                          f"(0 .. {args.num_instances - 1}).")
    env = {TOTAL_REPLICAS_ENV: str(args.num_replicas),
           IPUS_PER_REPLICA_ENV: str(args.ipus_per_replica)}
    if args.executable_cache_path:
        env["POPTORCH_CACHE_DIR"] = args.executable_cache_path
    env.update(_exports(args.exports, [args.mpi_global_args, args.mpi_local_args]))
    ignored = [flag for flag, _, _ in _IPU_ONLY_FLAGS
               if getattr(args, flag[2:].replace("-", "_")) is not None]
    ignored += [flag for flag, _ in _IPU_ONLY_SWITCHES
                if getattr(args, flag[2:].replace("-", "_"))]
    common = ["--nproc-per-node", str(per_host), "--no-python"]
    if args.tag_output:
        common += ["--tee", "3"]
    commands = []
    for rank, _host in enumerate(hosts):
        if len(hosts) == 1:
            head = ["torchrun", "--standalone"]
        else:
            head = ["torchrun", "--nnodes", str(len(hosts)), "--node-rank", str(rank),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0]}:{RDZV_PORT}",
                    "--rdzv-id", "poprun"]
        filters = []
        if args.only_output_from_instance is not None:
            local = args.only_output_from_instance - rank * per_host
            if not 0 <= local < per_host:
                filters = ["--redirects", "3"]  # not on this host: its output off
            else:
                filters = ["--local-ranks-filter", str(local)]
        commands.append(head + common + filters + list(program))
    return Plan(commands, env, hosts, ignored)


def _shell(command: list[str], env: dict[str, str]) -> str:
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return f"{exports} {shlex.join(command)}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        plan = build_plan(argv)
    except PoprunError as e:
        print(e, file=sys.stderr)
        return 2
    if plan.ignored:
        print(f"poprun: {', '.join(plan.ignored)}: IPU system settings, no effect here "
              "(see poprun --help).", file=sys.stderr)
    if "--print-torchrun" in argv or not plan.runs_here:
        if not plan.runs_here:
            print(f"poprun: {len(plan.hosts)} hosts: run on each host the command below "
                  "(torchrun starts that host's instances and meets the others at the "
                  "rendezvous).", file=sys.stderr)
        for host, command in zip(plan.hosts, plan.commands, strict=False):
            prefix = "" if plan.runs_here else f"# on {host}\n"
            print(prefix + _shell(command, plan.env))
        return 0
    env = dict(os.environ, **plan.env)
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    command = [sys.executable, "-m", "torch.distributed.run", *plan.commands[0][1:]]
    os.execvpe(command[0], command, env)
    return 0  # not reached
