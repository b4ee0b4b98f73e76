"""Writing a run's checkpoints: at once, or with --async-save in the background while training
goes on (published before the next save, or at the end)."""

from __future__ import annotations

from pathlib import Path

from paratron.checkpoint.save import BackgroundSave, CheckpointContent, begin_save
from paratron.config.schema import Config
from paratron.data.sft import tokenizer_chat_template
from paratron.data.tokenizer import AnyTokenizer, Tokenizer
from paratron.distributed.topology import Topology
from paratron.optim.protocol import TrainingOptimizer
from paratron.parallel.model import ParallelModel
from paratron.training.metrics import MetricsWriter
from paratron.training.resume import Restorer, TrainState


class CheckpointSaver:
    """Saves this rank's part of the run's checkpoints (every rank takes part in each save)."""

    def __init__(
        self,
        config: Config,
        topology: Topology,
        model: ParallelModel,
        optimizer: TrainingOptimizer,
        tokenizer: AnyTokenizer | None,
        restorer: Restorer,
        writer: MetricsWriter,
    ) -> None:
        self.config, self.topology, self.model, self.optimizer = config, topology, model, optimizer
        self.tokenizer, self.restorer, self.writer = tokenizer, restorer, writer
        self.chat_template = trained_template(config, tokenizer)
        self._background: BackgroundSave | None = None

    def save(self, root: Path, state: TrainState) -> Path:
        """Save a checkpoint of `state`; with --async-save start writing it and return (see `finish`)."""
        self.finish()
        self.model.wait_param_gather()
        content = CheckpointContent(
            state.iteration,
            state.consumed_samples,
            self.config,
            self.model.module,
            self.optimizer,
            self.tokenizer,
            self.restorer.rank_state(state),
            chat_template=self.chat_template,
        )
        background = self.config.checkpoint.async_save
        pending = begin_save(root, content, self.topology, snapshot=background)
        if not background:
            pending.write()
            return pending.publish()
        self._background = BackgroundSave(pending)
        return pending.final

    def finish(self) -> None:
        """Publish the checkpoint being written in the background, if any (every rank)."""
        if self._background is not None:
            path = self._background.finish()
            self._background = None
            self.writer.info(f"published checkpoint {path} (written in the background)")


def trained_template(config: Config, tokenizer: AnyTokenizer | None) -> str | None:
    """The source of the chat template a --sft run renders with, when the tokenizer's folder does not already hold
    it (--chat-template chatml, llama3 or a file): its checkpoints keep it, so that evaluate --sft, generate, serve
    and a conversion to Hugging Face use it without being told again."""
    d = config.data
    if not d.sft or d.chat_template == "tokenizer" or not isinstance(tokenizer, Tokenizer):
        return None
    return tokenizer_chat_template(d.chat_template, tokenizer).source
