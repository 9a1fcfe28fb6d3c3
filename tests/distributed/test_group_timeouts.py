"""Every process group the package makes waits as long as the job's own group, not torch's default.
Was: under fsdp:hybrid_shard, init_device_mesh made the replicate and shard groups (from 4 ranks on)
with torch's default timeout (30 minutes under gloo), whatever timeout the job gave init_process_group."""

import datetime

import pytest
from dist_utils import run_ranks
from tiny import batches, tiny_llama

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

GROUP_TIMEOUT = 42.0


def _mesh_timeouts(rank, world):
    import os

    import torch

    from hf_memstack import prepare_model

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # 2 "nodes" of 2 ranks: a replicate and a shard group of 2 each
    model = prepare_model(tiny_llama(), "fp32+fsdp:hybrid_shard")
    model(**batches("llama", seq=8)(2)).loss.backward()  # the groups work
    mesh = next(model.parameters()).device_mesh
    return {
        name: (mesh.get_group(name).size(), mesh.get_group(name)._get_backend(torch.device("cpu")).options._timeout)
        for name in mesh.mesh_dim_names
    }


def test_hybrid_shard_groups_time_out_as_the_jobs_group():
    for groups in run_ranks(_mesh_timeouts, world=4, timeout=300, group_timeout=GROUP_TIMEOUT):
        assert groups == {
            "replicate": (2, datetime.timedelta(seconds=GROUP_TIMEOUT)),
            "shard": (2, datetime.timedelta(seconds=GROUP_TIMEOUT)),
        }
