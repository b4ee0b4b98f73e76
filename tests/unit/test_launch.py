"""Multi-node launch settings (flags, Slurm), the rank grid's placement on nodes, and the format
of injected faults; no processes are started here (tests/integration/test_faults.py starts them)."""

from __future__ import annotations

import pytest

from paratron.config import build_config
from paratron.config.faults import Fault, parse_faults
from paratron.config.schema import ParallelConfig
from paratron.config.validation import validate
from paratron.distributed.launch import first_host, needs_agent, slurm_settings
from paratron.distributed.local_ranks import EPHEMERAL_PORTS, free_port
from paratron.distributed.topology import Axis, ParallelDims
from paratron.errors import ConfigError

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "4",
    "SLURM_NTASKS": "4",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "gpu[007-009,012]",
}


@pytest.mark.parametrize(
    "nodelist, host",
    [("gpu[007-009,012]", "gpu007"), ("node1,node2", "node1"), ("a-b[3]", "a-b3"), ("solo", "solo")],
)
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_slurm_fills_the_launch_settings_and_flags_win():
    settings = slurm_settings(SLURM, ParallelConfig(nproc_per_node=8))
    assert (settings.nnodes, settings.node_rank, settings.nproc_per_node) == (4, 2, 8)
    assert settings.rdzv_endpoint == "gpu007:29500" and settings.rdzv_id == "slurm-4242"
    assert needs_agent(settings)
    given = ParallelConfig(nproc_per_node=8, master_addr="10.0.0.1", node_rank=1, master_port=6000)
    settings = slurm_settings(SLURM, given)
    assert (settings.master_addr, settings.rdzv_endpoint, settings.node_rank) == ("10.0.0.1", None, 1)


def test_slurm_one_task_per_process_and_no_slurm_leave_the_settings_alone():
    given = ParallelConfig(nproc_per_node=2)
    assert slurm_settings(dict(SLURM, SLURM_NTASKS="32"), given) is given
    assert slurm_settings({}, given) is given
    assert not needs_agent(ParallelConfig()) and needs_agent(ParallelConfig(max_restarts=1))


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(nnodes=2, node_rank=2, master_addr="h"), "--node-rank 2 is out of range for --nnodes 2: use 0 to 1"),
        (dict(nnodes=2), "--nnodes 2 needs where the nodes meet: --master-addr HOST"),
        (dict(nnodes=2, master_addr="h", rdzv_endpoint="h:1"), "--master-addr and --rdzv-endpoint are two ways"),
        (dict(max_restarts=-1), "--max-restarts"),
        (dict(fault_inject=["1:0:crash"]), "--fault-inject 1:0:crash: expected RANK:STEP:KIND with STEP from 1"),
        (dict(fault_inject=["1:3:melt"]), "KIND one of crash, hang, nan, slow"),
        (dict(fault_inject=["2:3:crash"]), "--fault-inject 2:3:crash: rank 2 is outside the 2 ranks"),
    ],
)
def test_bad_launch_settings_are_one_line_errors(settings, message):
    with pytest.raises(ConfigError) as error:
        validate(build_config(dict(settings), recipe="debug"), 2)
    assert message in str(error.value)


def test_faults_parse_in_order():
    assert parse_faults(["0:3:crash", "1:5:nan"], 2) == [Fault(0, 3, "crash"), Fault(1, 5, "nan")]


@pytest.mark.parametrize("tp, cp, ep", [(2, 2, 1), (4, 1, 1), (2, 1, 2), (1, 2, 2)])
def test_tensor_then_context_then_expert_groups_stay_inside_a_node(tp, cp, ep):
    """The grid's order (TP fastest, then CP, EP): with 4 processes per node, every TP, CP and EP
    group's members share a node whenever the group fits in one."""
    per_node, world = 4, 16
    dims = ParallelDims(world, tp=tp, cp=cp, pp=2, ep=ep)
    for axis, size in ((Axis.TP, tp), (Axis.CP, cp), (Axis.EP, ep)):
        groups = dims.group_ranks(axis)
        assert all(len(g) == size for g in groups)
        if tp * cp * (ep if axis is Axis.EP else 1) <= per_node:
            assert all(len({r // per_node for r in g}) == 1 for g in groups), (axis, groups)


def test_a_free_port_is_not_one_an_outgoing_connection_could_be_given():
    """A node retrying to reach a store not yet listening must not be able to connect to itself."""
    low = int(EPHEMERAL_PORTS.read_text().split()[0]) if EPHEMERAL_PORTS.is_file() else None
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # (drawn, not one fixed port)
    if low is not None:
        assert all(10_000 <= port < low for port in ports), (low, sorted(ports))
