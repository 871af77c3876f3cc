"""The shadows that follow a step through a model runner and report it to a `StepObserver`.

`RunnerAdapter.observe` lays one `StepShadows` over a runner for a session (a recorder's, or a
replayed step's). Each method below wraps one runner or model method, in the order a step runs
them; where each method lives on the runner is the adapter's business (`RunnerAdapter.observe`,
`model_call_shadows`).
"""

from typing import Any, Callable

from tracekit.integrations.seam import ModelCall, Phase, StepObserver


class StepShadows:
    """One session's wrappers: each takes the method it shadows and returns what runs instead."""

    def __init__(self, adapter: Any, observer: StepObserver, replay_call: ModelCall | None = None):
        self.adapter = adapter
        self.observer = observer
        self.replay_call = replay_call  # takes the place of every model call (a replay)
        self.logits_pending = False  # the next compute_logits of the step is its sampling logits
        self.grammar_pending = False  # sample_tokens received a grammar mask for this step
        self.scheduler_output: Any = None  # of the step in progress

    def execute_model(self, original: Callable) -> Callable:
        """A step starts (not a dummy run); a step that ends here (no `sample_tokens` follows)
        has no sampled ids."""
        def wrapper(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("dummy_run"):
                return original(scheduler_output, *args, **kwargs)
            if scheduler_output.total_num_scheduled_tokens == 0:
                self.observer.idle_step(scheduler_output)
                return original(scheduler_output, *args, **kwargs)
            self.adapter.step_begins()
            self.logits_pending = True
            self.scheduler_output = scheduler_output
            self.observer.step_started(scheduler_output)
            result = self._reporting_failures(original)(scheduler_output, *args, **kwargs)
            if self.observer.tracking and result is not None:
                self.observer.output_receiver().received(None)
            return result

        return wrapper

    def model_call(self, original: Callable) -> Callable:
        """The forward: reported with its inputs before and its output after, or replaced."""
        if self.replay_call is not None:
            return lambda *args, **kwargs: self.replay_call(original, args, kwargs)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.observer.before_forward(*self.adapter.forward_inputs(args, kwargs))
            output = original(*args, **kwargs)
            self.observer.after_forward(output)
            return output

        return wrapper

    def compute_logits(self, original: Callable) -> Callable:
        """The step's first logits are its sampling logits (prompt logprobs come later)."""
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            logits = original(*args, **kwargs)
            if self.logits_pending:
                self.logits_pending = False
                self.observer.logits_computed(logits)
            return logits

        return wrapper

    def sample_tokens(self, original: Callable) -> Callable:
        """Sampling (and, with speculative decoding, the drafter), with the grammar mask the scheduler
        sent for it (structured outputs), which the observer gets first; the observer may read the
        drafter's proposals now, and takes the sampled ids when `sample_tokens`' output holds them."""
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            grammar_output = args[0] if args else kwargs.get("grammar_output")
            self.observer.sampling()
            self.grammar_pending = grammar_output is not None
            if self.grammar_pending and self.observer.tracking:
                scheduler_output, release = self.scheduler_output, self.adapter.release
                self.observer.grammar_received(lambda: release.grammar_record(grammar_output, scheduler_output))
            output = self._reporting_failures(original)(*args, **kwargs)
            self.logits_pending = self.grammar_pending = False
            if not self.observer.tracking:
                return output
            self.observer.drafts_proposed(self.adapter.proposals)
            return self.adapter.release.when_output_ready(output, self.observer.output_receiver())

        return wrapper

    def drafter_call(self, original: Callable) -> Callable:
        """A call of the speculative drafter's model (inside `sample_tokens`), reported with its
        keyword inputs and its output."""
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            output = original(*args, **kwargs)
            if self.observer.tracking:
                self.observer.drafter_called(kwargs, output)
            return output

        return wrapper

    def grammar_applied(self, logits: Any) -> None:
        """The runner masked the logits with this step's grammar; sampling reads them next (the
        adapter calls this where its runner kind goes from the one to the other)."""
        if self.grammar_pending and self.observer.tracking and logits is not None:
            self.observer.grammar_applied(logits)

    def bookkeeping(self, original: Callable) -> Callable:
        """The runner updates its request states with the sampled ids."""
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.observer.phase_entered(Phase.BOOKKEEPING)
            return original(*args, **kwargs)

        return wrapper

    def _reporting_failures(self, original: Callable) -> Callable:
        """`original`, reporting any exception it raises to the observer as the step's failure."""
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            except BaseException as error:
                self.observer.step_failed(error)
                raise

        return call
