"""The swarm and defense sections of the run configuration: how members exchange rollouts (sync or async, the
bounds on staleness and lead, a simulated delay, the open swarm's lease) and a receiver's guards against dishonest
peers."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .types import Section


class LatencySettings(Section):
    unit: Literal["steps", "seconds"] = Field(
        "steps", description="steps: a rollout made at the sender's step t reaches the receiver at its step t + delay; "
                             "seconds: it is delivered delay seconds after it was made.")
    min: float = Field(0.0, ge=0.0, allow_inf_nan=False, description="Smallest delay (whole steps when unit: steps).")
    max: float = Field(0.0, ge=0.0, allow_inf_nan=False,
                       description="Largest delay; each batch's delay is drawn uniformly from [min, max] (seeded by "
                                   "the run seed, sender, receiver and step). min == max: a fixed delay.")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        """`swarm.latency: 2` is a fixed delay of 2 steps."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return {"unit": "steps", "min": value, "max": value}
        return value

    @model_validator(mode="after")
    def _ordered(self) -> LatencySettings:
        if self.max < self.min:
            raise ValueError(f"max={self.max:g} is smaller than min={self.min:g}")
        if self.unit == "steps" and (self.min != int(self.min) or self.max != int(self.max)):
            raise ValueError("unit steps: min and max must be whole numbers of steps")
        return self

    @property
    def is_zero(self) -> bool:
        return self.max == 0


# The shortest open-swarm lease: a member beats every lease / 4 from its I/O thread (polling every 20 ms) and the
# coordinator checks leases every lease / 4; a 1e-9 s lease gave 879 join/expire pairs in a 6-step run.
MIN_LEASE_S = 1.0


class SwarmSettings(Section):
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: every member waits for every member each step (the F-TIS paper); async: nobody "
                            "waits: a member publishes its rollouts when scored and trains on the peers' that have "
                            "arrived (HeteroRL / GEPO), within max_staleness and max_delay_s.")
    max_staleness: int = Field(
        8, ge=0, description="async: a peer rollout older than this many of the receiver's steps (its policy "
                             "version behind the receiver's) is dropped and counted in stale_dropped.")
    max_lead: int | None = Field(
        2, ge=0,
        description="async: a member starts training its step t only when every live peer has published its step "
                    "t - max_lead or later (it waits otherwise, counted in lead_wait_seconds), and takes no peer "
                    "rollout made more than max_lead versions ahead of its own; a sampler generates at most "
                    "max_lead + 1 rounds its learner has not taken. 0: lockstep, as sync mode; null: never wait "
                    "(a fast member runs away and the members stop learning from each other). Default 2: a fast "
                    "member still trains on rollouts of its slowest peer at most 2 versions old (prime-rl's default "
                    "async level), and waits only when it is 2 steps ahead.")
    max_peer_sequences: int | None = Field(
        None, ge=1,
        description="async: the most peer sequences one update takes (whole groups; each peer first up to its share "
                    "of a step, then the freshest policy versions); the rest wait for the next step while within "
                    "max_staleness, or are dropped and counted in surplus_dropped. Default: what a sync step gives "
                    "(the other members' share of a step, plus one round of every sampler).")
    peers_per_step: int | None = Field(
        None, ge=1, le=1024,
        description="Open swarm: each member sends its step's parcel straight to this many live peers, drawn afresh "
                    "each step (seeded by the run seed, its name and the step), and to the peers that drew it, over "
                    "CurveZMQ links that admit only live members' keys; it takes their parcels. The coordinator then "
                    "keeps only membership (who is live, where each listens, its key) and relays nothing: a member's "
                    "traffic stays about 2 x this many parcels a step however large the swarm. A member listens at "
                    "`train --join ... --listen ADDRESS` (without it, behind a NAT, it only dials). null: the "
                    "coordinator relays every parcel to every live member (all to all).")
    max_delay_s: float | None = Field(
        None, gt=0.0, allow_inf_nan=False,
        description="async: a peer rollout made longer ago than this (seconds, by the sender's clock) is dropped.")
    latency: LatencySettings = Field(
        default_factory=LatencySettings,
        description="async: a simulated delay added to every delivery (for delay studies on one machine).")
    timeout_s: float = Field(
        1800.0, gt=0.0, le=30 * 86400.0, allow_inf_nan=False,
        description="Timeout of every collective and every wait for a peer: a dead or hung peer ends the run. "
                    "Members wait for each other's generation and eval (sync: every step, so it must exceed the "
                    "slowest member's eval); async, a member max_lead steps ahead gives a live peer that long, then "
                    "goes on without it until it catches up (in one world a peer that then takes no step for as "
                    "long again is hung and ends the run), and a sampler samples on.",
    )
    lease_s: float = Field(
        10.0, le=86400.0, allow_inf_nan=False,
        description="Open swarm (ftis-engine swarm serve): a member not heard from (heartbeats every second or "
                    "lease / 4, parcels) for this long is dropped from the live set; the coordinator's setting. At "
                    f"least {MIN_LEASE_S:g} s.")
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto", description="The default group's backend. auto: nccl when members are on GPUs, else gloo; gloo when "
                            "any member sets members.N.device (ranks may share a GPU, which NCCL refuses). A member "
                            "on several GPUs shards over NCCL either way.")
    weights_transport: Literal["auto", "links", "broadcast"] = Field(
        "auto", description="How a learner's weights reach its samplers (members.N.samplers). links: float32 over the "
                            "async links (ZeroMQ, TCP), through host memory. broadcast: one bf16 broadcast in the "
                            "member's own group, NCCL GPU to GPU (gloo on CPU or when members set a device). auto: "
                            "broadcast when the ranks are on distinct GPUs (NCCL), else links.")
    max_restarts: int = Field(0, ge=0, description="--nproc: elastic restarts of all ranks after a failure.")

    @field_validator("lease_s")
    @classmethod
    def _a_lease_beats_can_keep(cls, value: float) -> float:
        if not value >= MIN_LEASE_S:
            raise ValueError(f"{value:g} s is shorter than a member's beats can keep: they go out every lease / 4 "
                             "from a thread that shares its process with training, so a lease below "
                             f"{MIN_LEASE_S:g} s drops members that are alive (they rejoin without end and never "
                             f"see each other); at least {MIN_LEASE_S:g}")
        return value


class DefenseSettings(Section):
    check_claims: bool = Field(
        True, description="Refuse a parcel whose claimed generation log-probs no sampler can have made: a surprisal "
                          "beyond what any distribution over the vocabulary gives its samples (false alarm < 1e-9), "
                          "or branches of one prompt's completions whose claimed probabilities sum above 1.25 "
                          "(forged log-probs; exchange/verify.py, implausible_claims).")
    max_length_ratio: float | None = Field(
        None, gt=1.0, allow_inf_nan=False,
        description="Leave out a peer's group whose mean completion length is more than this many times the median "
                    "length of the receiver's own recent completions (the `long` attack: compute spent on needless "
                    "tokens; length_dropped, per peer in length_dropped_by). null: no guard.")
    max_peer_share: float | None = Field(
        None, gt=0.0, le=1.0, allow_inf_nan=False,
        description="No peer supplies more than this share of an update's sequences (its own and the peers' "
                    "together, as trained on: after likelihood_floor and claims_monitor have left theirs out): a "
                    "peer's groups beyond it are left out, its freshest kept (share_capped, per peer in "
                    "share_capped_by). null: no cap.")
    likelihood_floor: float | None = Field(
        None, lt=0.0, allow_inf_nan=False,
        description="Leave out a peer's group holding a completion with defense.likelihood_window consecutive tokens "
                    "whose mean log-prob under the receiver's own model (at the sampling temperature) is below this "
                    "(text the receiver would not write: a planted phrase; one extra no-grad forward over the "
                    "peers' tokens; likelihood_dropped, per peer in likelihood_dropped_by). null: no check.")
    likelihood_window: int = Field(4, ge=1, le=4096, description="Tokens per window of defense.likelihood_floor.")
    claims_monitor: bool = Field(
        False, description="Per peer, test that its claimed generation log-probs are honest against the receiver's "
                           "own model (the mean of min(exp(l - g), 2) cannot exceed 1 for sampled tokens; a "
                           "time-uniform test, false alarm < 1e-6 per peer and run); a peer that fails is quarantined "
                           "(its rollouts refused, quarantined / quarantined_by) until 3 steps of its claims look "
                           "honest (exchange/screen.py; one extra no-grad forward over the peers' tokens).")
