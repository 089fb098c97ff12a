"""How a plan is shown: rich tables for a terminal, or one JSON document (same numbers)."""

from __future__ import annotations

import dataclasses
from typing import Any

from rich.console import Console
from rich.table import Table

from parashift.plan.estimate import Plan, PlanSettings
from parashift.plan.kv_tiers import KVTiers, TierCapacity
from parashift.strategies.layout import MeshPoint, ShardPlan
from parashift.strategies.mesh import RankPlacement

GIB = 2**30


def to_json(plan: Plan, s: PlanSettings) -> dict[str, Any]:
    mesh = plan.mesh
    doc = {
        "model": plan.shape.name, "strategy": str(plan.spec), "fits": plan.fits,
        "runnable": plan.runnable, "errors": plan.errors, "warnings": plan.warnings,
        "parameters": plan.shape.total_params(), "active_parameters": plan.shape.active_params(),
        "max_model_len": plan.max_model_len, "quantization": s.quantization,
        "mesh": [_rank_row(plan, r) for r in mesh.ranks] if mesh else [],
        "api_server_cpus": list(mesh.api_server_cpus) if mesh else [],
        "memory_per_device": [dataclasses.asdict(st) for st in plan.stages],
        "kv_capacity": {"blocks": plan.kv_blocks, "tokens": plan.kv_tokens,
                        "max_length_sequences": plan.concurrent_max_len_seqs},
        "kv_tiers": dataclasses.asdict(plan.kv_tiers) if plan.kv_tiers else None,
        "pools": _pools(plan),
        "ranks_that_fit": plan.ranks_that_fit,
        "experts_per_rank": plan.experts_per_rank,
        "expert_options": plan.expert_options,
        "communication": plan.comm, "estimate": plan.estimate,
        "pipeline_bubble": plan.bubble,
    }
    if plan.dispatch:  # ep over several engines only
        doc["expert_placement"] = plan.expert_placement
        doc["dispatch"] = plan.dispatch
    return doc


def _pools(plan: Plan) -> dict[str, Any] | None:
    """Prefill/decode pools: each pool's engines, and the KV a handed-off prompt moves."""
    prefill = plan.spec.processes().prefill_engines
    if not prefill:
        return None
    engines = plan.spec.processes().num_engines
    host = plan.kv_tiers.host if plan.kv_tiers else None
    per_token = host.size_bytes and host.slot_bytes * host.blocks // host.tokens if (
        host and host.tokens) else None
    node_of = {r.engine: r.node for r in plan.mesh.ranks} if plan.mesh else {}
    prefill_nodes = {node_of.get(e, 0) for e in range(prefill)}
    away = [e for e in range(prefill, engines) if node_of.get(e, 0) not in prefill_nodes]
    links = ["the node's host KV tier (shared memory)"] if len(away) < engines - prefill else []
    if away:
        links.append(f"for {', '.join(f'dp{e}' for e in away)} on other nodes, the head's KV "
                     "server over TCP (ZMQ, CURVE) into their node's tier")
    return {"prefill": list(range(prefill)), "decode": list(range(prefill, engines)),
            "kv_link": "; ".join(links), "kv_bytes_per_prompt_token": per_token}


def _show_pools(pools: dict[str, Any], console: Console) -> None:
    def ranks(pool: list[int]) -> str:
        return ", ".join(f"dp{r}" for r in pool)

    per_token = pools["kv_bytes_per_prompt_token"]
    console.print(f"prefill pool: {ranks(pools['prefill'])}; decode pool: "
                  f"{ranks(pools['decode'])}; a prompt's KV goes from one to the other "
                  f"through {pools['kv_link']}"
                  + (f", {per_token:,} bytes per prompt token" if per_token else ""))


def _rank_row(plan: Plan, rank: RankPlacement) -> dict[str, Any]:
    row = dataclasses.asdict(rank)
    row.update(row.pop("coords"))
    row["cpu_ids"] = list(rank.cpu_ids)
    shard = _ep_shard(plan, rank)
    row["ep"] = shard.ep_rank if shard else None
    row["experts"] = list(shard.experts) if shard and shard.experts else None
    return row


def _ep_shard(plan: Plan, rank: RankPlacement) -> ShardPlan | None:
    """The rank's place in its expert-parallel group and its experts, from the strategy's
    shard plan (None without ep)."""
    if plan.spec.axis("ep") is None:
        return None
    at = MeshPoint(rank.coords, plan.spec.sizes())
    return plan.spec.shard(at, plan.shape.as_hf_config())


def _ep_cell(plan: Plan, rank: RankPlacement) -> str:
    shard = _ep_shard(plan, rank)
    if shard is None:
        return "-"
    if not shard.experts:
        return str(shard.ep_rank)
    first, end = shard.experts
    return f"{shard.ep_rank}: experts {first}-{end - 1}"


def show(plan: Plan, s: PlanSettings, console: Console) -> None:
    shape = plan.shape
    console.print(f"[bold]{shape.name}[/] ({shape.total_params() / 1e9:.1f} B parameters"
                  + (f", {shape.active_params() / 1e9:.1f} B active" if shape.is_moe else "")
                  + f") as [bold]{plan.spec}[/] on {s.devices} x {s.device.name}"
                  + (f" over {s.nodes} nodes" if s.nodes > 1 else "")
                  + f", max_model_len {plan.max_model_len}"
                  + (f", weights {s.quantization}" if s.quantization else ""))
    if plan.mesh is not None:
        mesh = plan.mesh
        names = list(mesh.ranks[0].coords) if mesh.ranks else []
        table = Table(title="device mesh")
        for col in ("rank", "node", "device", *names, "ep", "process"):
            table.add_column(col)
        for r in mesh.ranks:
            table.add_row(str(r.rank), str(r.node), r.device, *(str(r.coords[n]) for n in names),
                          _ep_cell(plan, r), r.process_name)
        console.print(table)
        if mesh.api_server_cpus:
            console.print(f"API servers on cpu{list(mesh.api_server_cpus)}")
    table = Table(title="memory per device (GiB)")
    for col in ("pp stage", "layers", "weights", "reserve", "KV cache", "free", "KV tokens"):
        table.add_column(col, justify="right")
    for st in plan.stages:
        layers = (f"{st.layers} ({st.first_layer}-{st.first_layer + st.layers - 1})"
                  if len(plan.stages) > 1 else str(st.layers))
        table.add_row(str(st.stage), layers, f"{st.weights / GIB:.2f}",
                      f"{st.reserve / GIB:.2f}", f"{st.kv_cache / GIB:.2f}",
                      f"{st.free / GIB:.2f}", f"{st.kv_tokens:,}")
    console.print(table)
    console.print(f"KV capacity per replica: {plan.kv_blocks:,} blocks = {plan.kv_tokens:,} "
                  f"tokens = {plan.concurrent_max_len_seqs:.1f} max-length sequences"
                  + (f"; {plan.experts_per_rank} experts per rank" if plan.experts_per_rank
                     else ""))
    console.print(f"this machine holds {plan.ranks_that_fit} rank(s) of this layout (the "
                  "ceiling for --data-parallel-size-max)")
    if plan.kv_tiers:
        _show_kv_tiers(plan.kv_tiers, console)
    if pools := _pools(plan):
        _show_pools(pools, console)
    if plan.expert_options:
        _show_expert_options(plan, console)
    if plan.dispatch:
        _show_expert_dispatch(plan, console)
    if plan.comm:
        table = Table(title="communication per step")
        for col in ("what", "count", "bytes per token", "more"):
            table.add_column(col)
        for name, c in plan.comm.items():
            more = ", ".join(f"{k.replace('_', ' ')} {v:,.0f}" for k, v in c.items()
                             if k not in ("count_per_step", "bytes_per_token"))
            table.add_row(name, f"{c['count_per_step']:.0f}", f"{c['bytes_per_token']:,.0f}",
                          more)
        console.print(table)
    if plan.estimate:
        e = plan.estimate
        console.print(f"estimate: decode {e['decode_tokens_per_s']:,.0f} tok/s at "
                      f"{e['decode_batch']:.0f} sequences per replica ({e['decode_context']:.0f}"
                      f" tokens of context), {e['tpot_ms']:.1f} ms per output token "
                      f"({e['tpot_single_ms']:.2f} ms for one sequence alone); prefill "
                      f"{e['prefill_tokens_per_s']:,.0f} tok/s")
    if plan.bubble:
        names = {"decode": "decode", "prefill": f"prefill ({s.prompt_len} in, "
                 f"{s.output_len} out)"}
        console.print("pipeline bubble (idle share of a stage) at " + "; ".join(
            f"{names[workload]}: " + ", ".join(f"{v:.0%} with {c} running"
                                               for c, v in levels.items())
            for workload, levels in plan.bubble.items()))
    for error in plan.errors:
        console.print(f"[red]error:[/] {error}")
    for warning in plan.warnings:
        console.print(f"[yellow]warning:[/] {warning}")


def _show_kv_tiers(tiers: KVTiers, console: Console) -> None:
    def held(t: TierCapacity) -> str:
        return f"{t.size_bytes / GIB:.2f} GiB = {t.blocks:,} blocks = {t.tokens:,} tokens"

    n = tiers.engines_per_node
    console.print(f"KV host tier per node: {held(tiers.host)}, shared by the node's "
                  + (f"{n} engines" if n > 1 else "engine"))
    if tiers.disk:
        console.print(f"KV disk tier per node: {held(tiers.disk)} in {tiers.disk_dir} "
                      "(warm across restarts)")


def _show_expert_options(plan: Plan, console: Console) -> None:
    table = Table(title="experts: replicated or sharded (ep: E // ranks each, the remainder "
                        "to the first ranks)")
    for col in ("option", "strategy", "experts per rank", "expert GiB per rank",
                "weights GiB per rank", "note"):
        table.add_column(col)
    for name, o in plan.expert_options.items():
        held = o["experts_per_rank"]
        shown = ", ".join(map(str, held)) if len(set(held)) > 1 else f"{held[0]} each"
        table.add_row(name, o["strategy"], shown, f"{o['expert_bytes_per_rank'] / GIB:.2f}",
                      f"{o['weight_bytes_per_rank'] / GIB:.2f}", "; ".join(o["errors"]))
    console.print(table)


def _show_expert_dispatch(plan: Plan, console: Console) -> None:
    table = Table(title="experts per node")
    for col in ("node", "ranks", "experts"):
        table.add_column(col)
    for n in plan.expert_placement:
        table.add_row(str(n["node"]), ", ".join(map(str, n["ranks"])), _id_ranges(n["experts"]))
    console.print(table)
    d = plan.dispatch
    groups = f"its {d['num_groups']} ep groups move" if d["num_groups"] > 1 else (
        "its ep group moves")
    peers = "the other rank" if d["group_size"] == 2 else (
        f"each of the {d['group_size'] - 1} other ranks")
    console.print(
        f"expert dispatch per token and step (the same expert ids in each of the "
        f"{d['moe_layers']} MoE layers; in each, a {d['bytes_per_token_per_layer']:,}-byte "
        f"hidden state to {peers} of the ep group and a partial back): a rank sends "
        f"{d['bytes_per_token']:,} bytes, "
        f"{d['cross_node_bytes_per_token']:,} of them to other nodes; {groups} "
        f"{d['total_cross_node_bytes_per_token']:,} bytes across nodes (for balanced ranks: "
        "each rank's block is padded to the largest rank's tokens)")


def _id_ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def show_ranking(plans: list[Plan], why: str, console: Console) -> None:
    table = Table(title="strategies that fit, best first")
    for col in ("#", "strategy", "decode tok/s", "TPOT ms", "TPOT ms (1 seq)", "prefill tok/s",
                "KV tokens", "runs today"):
        table.add_column(col, justify="right")
    for i, p in enumerate(plans, 1):
        e = p.estimate
        table.add_row(str(i), str(p.spec), f"{e['decode_tokens_per_s']:,.0f}",
                      f"{e['tpot_ms']:.1f}", f"{e['tpot_single_ms']:.2f}",
                      f"{e['prefill_tokens_per_s']:,.0f}",
                      f"{p.kv_tokens:,}", "yes" if p.runnable else "no")
    console.print(table)
    console.print(f"[bold]winner[/] {why}")
