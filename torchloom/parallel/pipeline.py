"""Pipeline parallelism: the decoder's layers split into stages, run by a torch schedule.

Each rank keeps only its stages' modules, under the single-process names (``layers.5`` stays
``layers.5``), so checkpoints and the HF export need no renaming. A stage is wrapped in
``_StageForward``, whose forward passes positions, document ids and the objective's batch fields
along with the hidden state, so the model code does not change: the last stage computes the
objective inside its forward, as the whole model does on one rank. Tensor and data parallelism
are applied to every stage on the non-pp sub-mesh before the stage is handed to
``torch.distributed.pipelining``. The model may be (and in training is) on the meta device: the
caller materializes the stages afterwards.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from torchloom.config.errors import ConfigError
from torchloom.data.packing import IGNORE_INDEX
from torchloom.models.components.decoder import Decoder, DecoderConfig, Objective
from torchloom.models.components.multimodal import media_encoder_names
from torchloom.parallel.config import (
    SPLIT_BACKWARD,
    ParallelConfig,
    schedule_class,
    stages_per_rank,
)
from torchloom.parallel.data_parallel import shard_pipeline_stage
from torchloom.parallel.expert_parallel import check_expert_parallel, has_moe_layers, moe_layers
from torchloom.parallel.loss_reduction import as_local
from torchloom.parallel.mesh import ParallelDims
from torchloom.parallel.parallelize import parallelize
from torchloom.parallel.state import full_state_items
from torchloom.parallel.tensor_parallel import TPPlan, loss_context


def zbv_runs_on(device_type: str) -> bool:
    """Whether this torch can run zbv here. Seen 2026-11-29: torch 2.11's multi-stage schedules
    send the V's two neighbouring stages on one rank a message to itself while setting up,
    which gloo cannot do (NCCL can); torch 2.13 no longer sends it."""
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return device_type != "cpu" or version >= (2, 13)


def microbatch_problem(config: ParallelConfig, microbatches: int, num_stages: int) -> str | None:
    """Why ``config``'s schedule cannot run ``microbatches`` over ``num_stages`` stages (what
    torch's schedules would refuse with a traceback), with the counts that would do; None when
    it can."""
    schedule = config.pp_schedule
    if schedule == "1f1b" and microbatches < num_stages:
        return f"it needs at least one microbatch per stage (>= {num_stages})"
    if schedule in ("interleaved_1f1b", "interleaved_zb"):
        rounds = max(1, microbatches // config.pp)
        if microbatches % rounds:
            near = [m for m in range(config.pp, 2 * microbatches + 1)
                    if m % max(1, m // config.pp) == 0]  # fmt: skip
            below = max(m for m in near if m < microbatches)
            above = min(m for m in near if m > microbatches)
            return (
                f"it runs them in rounds of about one per pp rank ({config.pp}), and "
                f"{microbatches} does not split into {rounds} equal rounds; e.g. {below} or "
                f"{above}"
            )
    return None


def _microbatches_named(config: ParallelConfig, microbatches: int) -> str:
    """The microbatch count as the user set it: the flag, or its default's meaning."""
    if config.pp_microbatches:
        return f"--parallel.pp_microbatches {microbatches}"
    return f"{microbatches} microbatches (--parallel.pp_microbatches 0: one per stage)"


def split_layers(
    num_layers: int,
    num_stages: int,
    embedding_weight: float,
    explicit: list[int] | None,
    ranks: int = 1,
) -> list[int]:
    """Layers per stage. Balanced by default, counting the embedding (stage 0) and
    the head (last stage) as ``embedding_weight`` layers each; or the user's explicit split.
    ``ranks``: the pipeline's ranks (--parallel.pp), each of which must get a layer."""
    if explicit is not None:
        if len(explicit) != num_stages or sum(explicit) != num_layers or min(explicit) < 0:
            raise ConfigError(
                f"--parallel.pp_layers_per_stage {explicit} must list {num_stages} non-negative "
                f"counts (one per stage) summing to the model's {num_layers} layers."
            )
        return list(explicit)
    total = num_layers + 2 * embedding_weight
    counts = [0] * num_stages
    for layer in range(num_layers):
        # A layer goes to the stage whose share of the total weight contains its midpoint.
        center = embedding_weight + layer + 0.5
        counts[min(num_stages - 1, math.floor(center * num_stages / total))] += 1
    # An end stage may hold only the embedding or the head (the balance counts them as layers:
    # 2 layers on 4 stages give [0, 1, 1, 0]), but an empty middle stage, or fewer layers than
    # pipeline ranks (a rank would hold no layer: 1 layer on pp 2 gives [0, 1]), is refused.
    empty = [s for s in range(1, num_stages - 1) if counts[s] == 0]
    if empty or num_layers < max(num_stages - 2, ranks):
        raise ConfigError(
            f"{num_layers} layer(s) cannot fill {num_stages} pipeline stages (layers per stage "
            f"{counts}); lower pp or pp_stages_per_rank, or pass --parallel.pp_layers_per_stage."
        )
    return counts


def local_stage_ids(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    """Stage indices of one rank: looped (s % pp == rank) or, for zbv, V-shaped."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def stage_model(model: Decoder, layer_ids: list[int], first: bool, last: bool) -> Decoder:
    """A Decoder holding (sharing, not copying) ``model``'s modules of one stage."""
    with torch.device("meta"):  # a shell: its own blocks are replaced right away
        stage = type(model)(model.config)
    stage.rope = model.rope
    stage.embed_tokens = model.embed_tokens if first else None
    for encoder in media_encoder_names(model):  # media encoders feed the embedding
        setattr(stage, encoder, getattr(model, encoder) if first else None)
    stage.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
    stage.norm = model.norm if last else None
    stage.output = model.output if last else None
    # A family's own modules after the blocks (deepseek_v4's hc_head) are the last stage's:
    # shared, not the shell's unmaterialized copies.
    done = {"rope", "embed_tokens", "layers", "norm", "output", *media_encoder_names(model)}
    for name, child in model.named_children():
        if last and name not in done:
            setattr(stage, name, child)
    return stage


_TARGET, _MEDIA = "target_", "media_"
"""Prefixes of the objective's batch fields and of the media tensors among a stage's keyword
arguments (the schedule cuts every tensor keyword into micro-batches; a dict it would not)."""


class _StageForward(nn.Module):
    """(tokens or hidden; positions, doc_ids, target_* and media_* fields as keywords) ->
    hidden, or the objective's loss sum on the last stage. Only the first stage holds a vision
    encoder, so only it reads the media. Only the hidden state travels between stages: every
    pp rank holds the batch, so the schedule hands each stage its microbatch's keywords (torch
    2.11's stages would also try to make received integer tensors require grad).

    Auxiliary losses that an earlier stage's layers report (MoE balance) cannot travel with the
    hidden state: the stage weights them as the objectives do (by the microbatch's label
    tokens), divides them by the step's normalizer and adds them to the step's loss through the
    hidden state's gradient (``_AddToLoss``); ``auxiliary`` keeps their sum for the log."""

    def __init__(self, model: Decoder, objective: Objective | None) -> None:
        super().__init__()
        self.model = model
        self.objective = objective
        self.divisor: torch.Tensor = torch.ones(())
        self.auxiliary: torch.Tensor = torch.zeros(())
        self.inferring = False

    @contextlib.contextmanager
    def metadata_inference(self) -> Iterator[None]:
        """A forward torch's stage runs to learn shapes (``_Stage``), not a training one: the
        MoE layers' token counts are put back afterwards and no auxiliary loss is kept."""
        counts = [(m, m.tokens_per_expert.clone()) for m in moe_layers(self.model)]
        self.inferring = True
        try:
            yield
        finally:
            self.inferring = False
            for layer, count in counts:
                layer.tokens_per_expert.copy_(count)
                layer.pop_auxiliary_losses()

    def forward(
        self,
        x: torch.Tensor,
        *,
        positions_BT: torch.Tensor,
        doc_ids_BT: torch.Tensor | None,
        **batch_fields: torch.Tensor,
    ) -> torch.Tensor:
        fields = {
            k.removeprefix(_TARGET): v for k, v in batch_fields.items() if k.startswith(_TARGET)
        }
        media = {k.removeprefix(_MEDIA): v for k, v in batch_fields.items() if k.startswith(_MEDIA)}
        extra = {"media": media} if media else {}
        if not self.model.has_head or self.objective is None:
            h = self.model(x, positions_BT, doc_ids_BT, **extra)
            terms = self.model.auxiliary_losses()
            if not terms or self.inferring:
                return h
            return self._add_auxiliary(h, sum(terms.values()), fields)
        out = self.model(
            x, positions_BT, doc_ids_BT, objective=self.objective, targets=fields, **extra
        )
        return out.loss.reshape(1)  # the schedule concatenates the micro-batches' outputs

    def _add_auxiliary(
        self, h: torch.Tensor, term: torch.Tensor, fields: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        if "labels" not in fields:
            raise ConfigError(
                "Layers before the last pipeline stage report auxiliary losses (MoE balance), "
                "which are weighted by label tokens, but the objective reads no labels; set "
                "--parallel.pp 1 or turn the layers' auxiliary loss off."
            )
        weighted = term * (fields["labels"] != IGNORE_INDEX).sum() / self.divisor
        self.auxiliary = self.auxiliary + weighted.detach()
        return _AddToLoss.apply(h, weighted)


class _Stage(PipelineStage):
    """torch's stage. From torch 2.13 it learns its inputs' and outputs' shapes by running the
    stage's forward on the first microbatch before the first step: that forward must not count
    as training (``_StageForward.metadata_inference``). Older versions lack the method: a no-op
    there."""

    def _forward_metadata_inference(self, *args, **kwargs):
        with self.submod.metadata_inference():
            return super()._forward_metadata_inference(*args, **kwargs)


class _AddToLoss(torch.autograd.Function):
    """The identity on a stage's output whose backward also gives ``loss`` the gradient 1:
    ``loss`` joins the step's loss wherever the pipeline's backward reaches this stage."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_like = (loss.shape, loss.dtype, loss.device)
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.loss_like
        return grad, torch.ones(shape, dtype=dtype, device=device)


class Pipeline:
    """This rank's stages and the schedule that runs them; built by ``build_pipeline``."""

    def __init__(
        self,
        stages: list[Decoder],
        wrappers: list[nn.Module],
        stage_ids: list[int],
        owners: list[int],
        dims: ParallelDims,
        microbatches: int,
        objective: Objective,
    ) -> None:
        self.stages = nn.ModuleList(stages)
        """This rank's stage models (optimizer, clipping, train/eval see these)."""
        self.wrappers = wrappers
        """The ``_StageForward`` module around each stage (what the schedule runs)."""
        self.stage_ids = stage_ids
        """Pipeline index of each of this rank's stages."""
        self.owners = owners
        """pp rank that holds each stage of the whole pipeline."""
        self.schedule = None
        self.dims = dims
        self.microbatches = microbatches
        self.num_stages = len(owners)
        self.has_last = any(s.has_head for s in stages)
        self.objective = objective
        self._divisor: torch.Tensor = torch.ones(())

    def local_model(self) -> Decoder:
        """One Decoder shell holding (sharing) every module of this rank's stages under the
        single-process names: what checkpoints save and load, so any layout reads them."""
        layers = sorted(
            ((int(name), block) for stage in self.stages for name, block in stage.layers.items()),
            key=lambda item: item[0],
        )
        embed = next((s.embed_tokens for s in self.stages if s.embed_tokens is not None), None)
        shell = stage_model(self.stages[0], [], first=False, last=False)
        shell.embed_tokens = embed
        for encoder in media_encoder_names(shell):  # the first stage's media encoders
            held = (getattr(s, encoder) for s in self.stages if getattr(s, encoder) is not None)
            setattr(shell, encoder, next(held, None))
        shell.layers = nn.ModuleDict({str(i): block for i, block in layers})
        has_head = [s for s in self.stages if s.output is not None]
        shell.norm = has_head[0].norm if has_head else None
        shell.output = has_head[0].output if has_head else None
        return shell

    def check_batch_size(self, size: int) -> None:
        """The schedule cuts each batch into ``microbatches`` equal parts."""
        if size % self.microbatches:
            config = self.dims.degrees
            runs = [m for m in range(1, size + 1) if size % m == 0 and
                    microbatch_problem(config, m, self.num_stages) is None]  # fmt: skip
            runs = [m for m in runs if m >= self.num_stages] or runs  # no stage left idle
            fix = (
                f"choose --parallel.pp_microbatches {' or '.join(map(str, runs[:4]))}"
                if runs
                else f"raise --training.micro_batch_size to a multiple of {self.num_stages}"
            )
            raise ConfigError(
                f"The rank's batch of {size} sequences does not split into "
                f"{_microbatches_named(config, self.microbatches)}; {fix} (a count must "
                f"divide the batch and the {config.pp_schedule} schedule must run it over "
                f"{self.num_stages} stages)."
            )

    def _loss(self, loss_sum: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # The last stage's forward already computed the objective; the target is a stand-in.
        return loss_sum.sum() / self._divisor

    def _keywords(self, batch) -> dict[str, torch.Tensor | None]:
        # Every stage: earlier ones weight their layers' auxiliary losses by the labels.
        fields = batch.fields(self.objective.fields)
        return {"positions_BT": batch.positions, "doc_ids_BT": batch.doc_ids,
                **{_TARGET + name: value for name, value in fields.items()},
                **{_MEDIA + name: value for name, value in batch.media.items()}}  # fmt: skip

    def step(self, batch, normalizer: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch, the loss being the objective's sum / ``normalizer``;
        returns this rank's summed microbatch losses (zero on ranks without the last stage)."""
        self.check_batch_size(batch.tokens.shape[0])
        self._divisor = normalizer
        for wrapper in self.wrappers:
            wrapper.divisor = normalizer
            wrapper.auxiliary = torch.zeros((), device=normalizer.device)
        losses: list[torch.Tensor] = []
        first = any(s.embed_tokens is not None for s in self.stages)
        args = (batch.tokens,) if first else ()
        target = batch.tokens if self.has_last else None  # cut per micro-batch, then unused
        with loss_context(self.dims):
            self.schedule.step(*args, target=target, losses=losses, **self._keywords(batch))
        total = torch.zeros((), device=batch.tokens.device)
        for loss in losses:
            total += as_local(loss.detach()).float()
        for wrapper in self.wrappers:  # earlier stages' auxiliary losses
            total += wrapper.auxiliary
        return total

    @torch.no_grad()
    def eval_loss_sum(self, batch) -> torch.Tensor:
        """The objective's sum over one batch, forward only (zero on ranks without the last
        stage).

        Runs the stages by hand, whole batch at once, in stage order, sending only the hidden
        state (every rank has the batch's positions and doc_ids): simpler than the schedules'
        ``eval``, which is not available for every schedule (zbv fails) in every torch version.
        """
        pp_mesh = self.dims.mesh("pp")
        assert pp_mesh is not None
        me, ranks = pp_mesh.get_local_rank(), pp_mesh.mesh.flatten().tolist()
        group = pp_mesh.get_group()
        total = torch.zeros((), device=batch.tokens.device)
        h = batch.tokens
        for s, owner in enumerate(self.owners):
            if owner != me:
                continue
            previous = self.owners[s - 1] if s > 0 else me
            if previous != me:
                meta: list = [None]
                dist.recv_object_list(meta, src=ranks[previous], group=group)
                h = torch.empty(meta[0][0], dtype=meta[0][1], device=batch.tokens.device)
                dist.recv(h, src=ranks[previous], group=group)
            # Through the wrapper: with FSDP it is the root, which must run forward first.
            wrapper = self.wrappers[self.stage_ids.index(s)]
            with loss_context(self.dims):
                h = wrapper(h, **self._keywords(batch))
                if s == len(self.owners) - 1:
                    total += as_local(h).sum()
                    continue
            following = self.owners[s + 1]
            if following != me:
                meta = [(tuple(h.shape), h.dtype)]
                dist.send_object_list(meta, dst=ranks[following], group=group)
                dist.send(h.contiguous(), dst=ranks[following], group=group)
        return total

    def reduce_over_stages(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the pp ranks: the last stage's loss on every rank."""
        value = value.clone()
        mesh = self.dims.mesh("pp")
        if mesh is not None:
            dist.all_reduce(value, group=mesh.get_group())
        return value

    def full_state_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every full tensor of the whole model, yielded on global rank 0 stage by stage (the
        leader of each other stage sends its tensors one at a time). Every rank must exhaust
        it; what ranks other than 0 yield is meaningless."""
        pp_mesh = self.dims.mesh("pp")
        assert pp_mesh is not None
        pp_rank, leaders = pp_mesh.get_local_rank(), pp_mesh.mesh.flatten().tolist()
        is_leader = leaders[0] == 0  # my pp group is global rank 0's
        device = next(self.stages.parameters()).device
        for p in range(len(leaders)):
            if pp_rank == p:
                names = [n for s in self.stages for n in s.state_dict()]
                if p > 0 and is_leader:
                    dist.send_object_list([names], dst=0)
                for stage in self.stages:
                    for name, tensor in full_state_items(stage):
                        if p > 0 and is_leader:
                            meta = [(tuple(tensor.shape), tensor.dtype)]
                            dist.send_object_list(meta, dst=0)
                            dist.send(tensor.to(device), dst=0)
                        yield name, tensor
            elif self.dims.is_rank0:
                box: list = [None]
                dist.recv_object_list(box, src=leaders[p])
                for name in box[0]:
                    meta: list = [None]
                    dist.recv_object_list(meta, src=leaders[p])
                    shape, dtype = meta[0]
                    buffer = torch.empty(shape, dtype=dtype, device=device)
                    dist.recv(buffer, src=leaders[p])
                    yield name, buffer.cpu()


def layers_per_stage(model_config: DecoderConfig, config: ParallelConfig) -> list[int]:
    """Check everything about a pipeline layout that is known before the run (tied embeddings,
    the schedule, stages per rank, the split) and return the layers of every stage."""
    if model_config.tie_embeddings:
        raise ConfigError(
            "Pipeline parallelism cannot split a model with tied embeddings (the embedding is "
            "also the output head, on the first and last stage); set --parallel.pp 1."
        )
    schedule_class(config.pp_schedule)
    data_parallel = config.dp_shard > 1 or config.dp_replicate > 1 or config.cp > 1
    if config.pp_schedule in SPLIT_BACKWARD and data_parallel:
        # Measured on torch 2.13 (gloo): FSDP x zbv / interleaved_zb runs but its gradients
        # are off by ~5% (grad-norm 0.1 of 2), so it is refused rather than silently wrong.
        raise ConfigError(
            f"--parallel.pp_schedule {config.pp_schedule} (zero-bubble, split weight backward) "
            "does not give correct gradients with data parallelism here; use 1f1b or "
            "interleaved_1f1b with dp_shard / dp_replicate > 1."
        )
    num_stages = config.pp * stages_per_rank(config)
    return split_layers(
        model_config.num_layers, num_stages, config.pp_embedding_weight,
        config.pp_layers_per_stage, ranks=config.pp,
    )  # fmt: skip


def check_deepstack_on_first_stage(model: Decoder, first_stage_layers: int) -> None:
    """The vision encoder sits on the first stage, and its DeepStack tokens are added after the
    first decoder layers: those layers must be there too (the tokens do not travel)."""
    encoder = getattr(model, "media_encoder", None)
    deepstack = len(getattr(getattr(encoder, "cfg", None), "deepstack_layers", ()))
    if deepstack > first_stage_layers:
        raise ConfigError(
            f"The first pipeline stage holds {first_stage_layers} layer(s) but the vision "
            f"encoder's DeepStack tokens join decoder layers 0..{deepstack - 1}, which must be on "
            f"that stage; pass --parallel.pp_layers_per_stage with a first count >= {deepstack}."
        )


def build_pipeline(
    model: Decoder,
    dims: ParallelDims,
    *,
    seq_len: int,
    tp_plan: TPPlan,
    device: torch.device,
    objective: Objective,
    wrap_blocks: Callable[[nn.Module], None] | None = None,
) -> Pipeline:
    """Split ``model`` into this rank's stages, apply TP and data parallelism to each, and build
    the schedule, whose last stage computes ``objective``. Build ``model`` on the meta device
    and materialize ``Pipeline.stages`` afterwards (``to_empty``, then initialize or load):
    the other ranks' layers are never allocated."""
    config = dims.degrees
    counts = layers_per_stage(model.config, config)
    check_deepstack_on_first_stage(model, counts[0])
    check_expert_parallel(model, config.ep)
    if has_moe_layers(model):
        dims.moe_meshes()  # a collective: every rank, before stages without MoE layers split off
    if config.pp_schedule == "zbv" and not zbv_runs_on(device.type):
        raise ConfigError(
            f"--parallel.pp_schedule zbv does not run on the CPU (gloo) with torch "
            f"{torch.__version__} (it needs torch >= 2.13 there); use interleaved_zb, or GPUs."
        )
    cls = schedule_class(config.pp_schedule)
    per_rank = stages_per_rank(config)
    num_stages = config.pp * per_rank
    microbatches = config.pp_microbatches or num_stages
    problem = microbatch_problem(config, microbatches, num_stages)
    if problem is not None:
        raise ConfigError(
            f"--parallel.pp_schedule {config.pp_schedule} cannot run "
            f"{_microbatches_named(config, microbatches)} over {num_stages} stages: {problem}."
        )
    pp_mesh = dims.mesh("pp")
    assert pp_mesh is not None, "build_pipeline needs --parallel.pp > 1"
    starts = [sum(counts[:s]) for s in range(num_stages)]
    owners = [0] * num_stages
    for p in range(config.pp):
        for s in local_stage_ids(p, config.pp, per_rank, config.pp_schedule):
            owners[s] = p
    stage_ids = local_stage_ids(pp_mesh.get_local_rank(), config.pp, per_rank, config.pp_schedule)
    stages, wrappers, pipe_stages = [], [], []
    for s in stage_ids:
        layer_ids = list(range(starts[s], starts[s] + counts[s]))
        stage = stage_model(model, layer_ids, s == 0, s == num_stages - 1)
        parallelize(stage, dims, seq_len=seq_len, tp_plan=tp_plan, wrap_blocks=wrap_blocks)
        stages.append(stage)
        wrapper = _StageForward(stage, objective)
        shard_pipeline_stage(wrapper, dims)
        wrappers.append(wrapper)
        pipe_stages.append(_Stage(wrapper, s, num_stages, device, group=pp_mesh.get_group()))
    pipeline = Pipeline(stages, wrappers, stage_ids, owners, dims, microbatches, objective)
    stage_arg = pipe_stages[0] if per_rank == 1 else pipe_stages
    try:
        pipeline.schedule = cls(
            stage_arg, n_microbatches=microbatches, loss_fn=pipeline._loss, scale_grads=False
        )
    except ValueError as err:  # a rule of this torch's schedules microbatch_problem lacks
        raise ConfigError(
            f"--parallel.pp_schedule {config.pp_schedule} with "
            f"{_microbatches_named(config, microbatches)} over {num_stages} stages: {err} "
            "Change --parallel.pp_microbatches or the schedule."
        ) from None
    return pipeline
