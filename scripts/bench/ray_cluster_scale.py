"""Ray's side of scripts/cluster-scale.sh: NODES raylets on this machine
(ray.cluster_utils.Cluster, each with 4 CPUs), one single-bundle STRICT_PACK placement group per
node and 4 one-CPU actors in each bundle, then one call at a time to every actor; twice ("cold"
on fresh raylets, then "warm" after killing the first actors and removing their groups), as
scripts/cluster-scale.sh runs rtrun's driver twice.

Prints the same `key value` lines as rtrun's scale_driver (groups, actors, calls, nodes) for each,
the resident memory of one raylet and of the GCS, and a `json {...}` line.

Usage: python ray_cluster_scale.py NODES [ROUNDS]
"""

import json
import os
import sys
import time

import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def rss_kib(pattern):
    """Resident memory (KiB) of the processes whose command line contains `pattern`."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            if pattern not in cmd:
                continue
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out.append(int(line.split()[1]))
        except OSError:
            continue
    return out


@ray.remote(num_cpus=1)
class Worker:
    def node(self):
        return ray.get_runtime_context().get_node_id()

    def ping(self, n):
        return n + 1


def main():
    nodes = int(sys.argv[1])
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    start = time.perf_counter()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    for _ in range(nodes):
        cluster.add_node(num_cpus=4)
    ray.init(address=cluster.address, logging_level="ERROR")
    cluster.wait_for_nodes()
    print(f"joined {nodes} started_s {time.perf_counter() - start:.1f}", flush=True)

    figures = {}
    for attempt in ("cold", "warm"):
        start = time.perf_counter()
        groups = [placement_group([{"CPU": 4}], strategy="STRICT_PACK") for _ in range(nodes)]
        ray.get([g.ready() for g in groups], timeout=600)
        created = time.perf_counter() - start
        start = time.perf_counter()
        actors = []
        for g in groups:
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=g, placement_group_bundle_index=0)
            actors += [Worker.options(scheduling_strategy=strategy).remote() for _ in range(4)]
        where = ray.get([a.node.remote() for a in actors], timeout=1200)
        alive = time.perf_counter() - start
        latencies = []
        for r in range(rounds):
            for i, a in enumerate(actors):
                n = r * len(actors) + i
                t = time.perf_counter()
                assert ray.get(a.ping.remote(n)) == n + 1
                latencies.append((time.perf_counter() - t) * 1e6)
        latencies.sort()
        p50 = latencies[len(latencies) // 2]
        p99 = latencies[min(len(latencies) - 1, round((len(latencies) - 1) * 0.99))]
        print(f"{attempt}: groups {nodes} created_s {created:.3f} groups_per_s {nodes / created:.1f}")
        print(f"{attempt}: actors {len(actors)} alive_s {alive:.3f} "
              f"actors_per_s {len(actors) / alive:.1f}")
        print(f"{attempt}: calls {len(latencies)} p50_us {p50:.1f} p99_us {p99:.1f}")
        print(f"{attempt}: nodes {len(set(where))}", flush=True)
        figures[attempt] = {"groups_per_s": nodes / created, "actors": len(actors),
                            "actors_per_s": len(actors) / alive, "call_p50_us": p50,
                            "call_p99_us": p99}
        for a in actors:
            ray.kill(a)
        for g in groups:
            ray.util.remove_placement_group(g)
        time.sleep(2)
    raylets = rss_kib("raylet/raylet")
    gcs = rss_kib("gcs_server")
    raylet = sorted(raylets)[len(raylets) // 2] if raylets else 0
    print(f"memory raylet_kib {raylet} gcs_kib {sum(gcs)}")
    print("json " + json.dumps({
        "nodes": nodes, **figures, "raylet_rss_kib": raylet, "gcs_rss_kib": sum(gcs),
    }))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
