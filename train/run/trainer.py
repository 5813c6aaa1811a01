"""train_and_evaluate: the training loop, composed from the config.

The state and batches are laid out on the mesh of `config.parallelism`
(train/program/mesh.py) as `config.logical_axis_rules` say
(train/program/sharding.py), by the run's program (train/run/program.py);
the same loop runs on one CPU, a GPU node or a multi-host TPU pod.
"""

from collections.abc import Callable, Iterator
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import ml_collections
import tqdm

from train.base import storage
from train.base.errors import InputError, Pruned, Stopped, TrainingError
from train.base.train_config import TrainConfig
from train.config import kernels
from train.config import validation as config_validation
from train.data import datasets, pipeline
from train.data.tasks import Task
from train.decode import decoding, seq2seq_eval, text
from train.program import flops, optim, windows
from train.run import checkpointing, init_from, metrics, preemption
from train.run import workdir as workdir_lib
from train.run.program import Program


def _say(message: str) -> None:
  """A status line on the terminal, from the first host only."""
  if jax.process_index() == 0:
    print(message, flush=True)


def _duration(seconds: float) -> str:
  minutes, seconds = divmod(round(seconds), 60)
  hours, minutes = divmod(minutes, 60)
  return (f'{hours}h{minutes:02d}m' if hours else
          f'{minutes}m{seconds:02d}s' if minutes else f'{seconds}s')


def corpus_line(corpus_sha256: str | None, track_corpus: str) -> str | None:
  """What a run says of its corpus: its fingerprint, and whether it is
  that of config.track_corpus's track; None for a dataset without one."""
  if corpus_sha256 is None:
    return None
  line = f'Corpus sha256 {corpus_sha256}'
  if not track_corpus:
    return line + '.'
  if corpus_sha256 == track_corpus:
    return line + ': on the track (config.track_corpus).'
  return (line + f': off the track, whose corpus is config.track_corpus='
          f'{track_corpus}; these figures are not comparable with its '
          'records.')


def closing_summary(*, task: Task, steps: tuple[int, int], seconds: float,
                    evaluations: list[tuple[int, dict[str, float]]],
                    final: dict[str, float], tokens_per_s: float | None,
                    checkpoint: str | None, workdir: str,
                    extendable: bool, cannot_decode: str | None,
                    corpus: str | None = None) -> str:
  """The lines a run trained to its last step ends with: steps and wall
  time (or that it was trained before, `steps` (last, last), and only
  evaluated), the final evaluation (the quality metric's best of the run
  beside it), throughput, its corpus (corpus_line), the last checkpoint,
  and what to run next: how
  to train further (`extendable`: a larger num_train_steps, else a new
  workdir starting from this one), and the task's decode command
  (`cannot_decode`: why it does not apply, see decoding.cache_refusal)."""
  metric, direction = task.quality_metric(final)
  shown = [f'{metric} {final[metric]:.4g}']
  values = [(summary[metric], step) for step, summary in evaluations
            if metric in summary]
  if len(values) > 1:
    value, step = (min if direction == 'min' else max)(values)
    shown[0] += f' (best {value:.4g}, step {step})'
  shown += [f'{key} {value:.4g}' for key, value in final.items()
            if key != metric]
  first, last = steps
  done = (f'Done: steps {first}-{last} in {_duration(seconds)}'
          if first < last else f'Already trained to step {last}, evaluated '
          f'again in {_duration(seconds)}')
  lines = [f'{done}; ' + ', '.join(shown)
           + (f'; {tokens_per_s:,.0f} tokens/s' if tokens_per_s else '') + '.']
  if corpus:
    lines.append(corpus)
  then = ['the run is complete: ' + (
      'to train it further, run the same command with a larger '
      'config.num_train_steps' if extendable else
      'its schedule ends at config.num_train_steps, so to train it further, '
      f'start a new --workdir from it with --config.init_from={workdir}')]
  if task.decode_command:
    action, module = task.decode_command
    then.append(f'{action}: python -m {module} --workdir={workdir}'
                if cannot_decode is None else
                f'python -m {module} does not apply: {cannot_decode}')
  lines.append((f'Last checkpoint: {checkpoint}; ' if checkpoint else '')
               + '; '.join(then) + '.')
  return '\n'.join(lines)


def _decoding_evaluation(config: TrainConfig,
                         dataset: datasets.Dataset, program: Program,
                         workdir: str) -> Callable[[Any], dict[str, float]]:
  """`params -> {decode_<split>_<score>: value}` for config.decode_splits:
  the first config.num_decode_examples inputs of each split decoded by beam
  search, config.batch_size at a time, laid out as training batches are.
  What was decoded is written to workdir/decoded/<split>.jsonl (see
  seq2seq_eval.write_decoded), replaced at each evaluation."""
  whole = NamedSharding(program.mesh, P())  # Every host reads the tokens.
  runs = []
  for split in config.decode_splits:
    decode_set = seq2seq_eval.take(dataset, split, config.num_decode_examples)
    num_tokens = seq2seq_eval.output_length(
        program.model_config, decode_set.source_len, 0,
        names=f'config.decode_splits ({split!r})')
    runs.append((decode_set, seq2seq_eval.beam_decoder(
        program.model, dataset.vocab_size, beam_size=config.beam_size,
        alpha=config.beam_alpha, num_tokens=num_tokens, out_sharding=whole)))

  def evaluate(params) -> dict[str, float]:
    summary = {}
    for decode_set, decoder in runs:
      hypotheses = seq2seq_eval.decode(decoder, params, decode_set,
                                       batch_size=config.batch_size,
                                       place=program.batch, progress=True)
      summary |= {f'decode_{decode_set.split}_{name}': value
                  for name, value in seq2seq_eval.score(
                      dataset, hypotheses, decode_set.references).items()}
      if jax.process_index() == 0:
        seq2seq_eval.write_decoded(
            f'{workdir}/decoded/{decode_set.split}.jsonl',
            decode_set, hypotheses)
    return summary
  return evaluate


def evaluation(config: TrainConfig, dataset: datasets.Dataset,
               program: Program, workdir: str, layout: str
               ) -> Callable[[Any], dict[str, float]]:
  """params -> the evaluation's summary: config.num_eval_steps batches of
  config.eval_split in rows of `layout`, and the decoding evaluation."""
  evaluate_decoding = _decoding_evaluation(config, dataset, program,
                                           workdir)

  def evaluate(params) -> dict[str, float]:
    totals, memory = None, program.fresh_memory()
    batches = pipeline.eval_batches(
        dataset, config.eval_split, seq_len=config.seq_len,
        batch_size=config.batch_size, num_batches=config.num_eval_steps,
        layout=layout, max_segments=program.model_config.max_segments_per_row)
    for batch in tqdm.tqdm(batches, desc=f'evaluating on {config.eval_split}',
                           unit='batch', leave=False,
                           disable=jax.process_index() != 0):
      sums, memory = program.eval_step(params, program.batch(batch), memory)
      totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    if totals is None:
      raise InputError(
          f'config.eval_split={config.eval_split!r} has no examples of at '
          f'most config.seq_len={config.seq_len} tokens.')
    return metrics.summarize_eval(jax.device_get(totals),
                                  byte_level=dataset.byte_level
                                  ) | evaluate_decoding(params)
  return evaluate


def _ranges(steps: list[int]) -> str:
  """[1, 2, 3, 9] -> '1-3, 9'."""
  runs = []
  for step in steps:
    if runs and runs[-1][1] == step - 1:
      runs[-1][1] = step
    else:
      runs.append([step, step])
  return ', '.join(f'{a}-{b}' if b > a else f'{a}' for a, b in runs)


def _say_what_runs(config: TrainConfig, program: Program, workdir: str,
                   first_step: int) -> None:
  """The run's first lines: the model, its size and devices, the config's
  warnings, the steps each call runs, and the kernel each self-attention
  runs."""
  model_config = program.model_config
  split = mesh_shown(dict(program.mesh.shape))
  devices = jax.device_count()
  _say(f'{model_config.family} on {config.dataset}: {program.num_params:,} '
       f'parameters, {devices} {jax.default_backend().upper()} '
       f'device{"s" if devices > 1 else ""} ({split}, '
       f'{config.parallelism.strategy}), workdir {workdir}')
  for warning in config_validation.warnings_of(config):
    _say(f'Warning: {warning}')
  if jax.process_count() > 1:  # Every host says which rows it reads.
    print(f'Host {jax.process_index()} of {jax.process_count()} prepares '
          f'rows {_ranges(program.local_rows)} of each training batch of '
          f'{config.batch_size}.', flush=True)
  if config.steps_per_call > 1:
    single = [step + 1 for step, count in calls(
        first_step, config.num_train_steps, config.steps_per_call,
        windows.boundaries(config)) if count == 1]
    _say(f'{config.steps_per_call} steps a call'
         + (f'; steps {_ranges(single)} one at a time (a program of their '
            'own)' if single else '') + '.')
  schedule = windows.describe(config)
  if schedule:
    _say(schedule)
  if program.kernels:
    _say('Attention kernels: '
         + '; '.join(layers.describe() for layers
                     in kernels.grouped(config, program.kernels)))


def _train_log(config: TrainConfig, program: Program,
               writer: metrics.MetricWriter) -> metrics.TrainLog:
  """The training metrics' log, with the step's model FLOPs for MFU and
  config.nan_policy's guard."""
  model_config = program.model_config
  flops_per_step = config.batch_size * flops.train_flops_per_example(
      model_config, program.task, config.seq_len,
      flops.non_embedding_params(
          program.abstract_state.params,
          model_config.moe.top_k / max(model_config.moe.num_experts, 1)))
  return metrics.TrainLog(
      writer, config.log_every, config.num_train_steps,
      metrics.NonFiniteGuard(config.nan_policy, config.max_skipped_steps),
      flops_per_step=flops_per_step,
      peak_flops_per_s=flops.peak_flops_per_s())


def _say_a_sample(config: TrainConfig, program: Program,
                  dataset: datasets.Dataset, params) -> None:
  """Text the trained model continues config.sample_prompt with."""
  # Whole on every device: every host runs the sampling and can read it.
  # Positions stay below seq_len, the longest the model was trained on.
  [sample] = text.continue_text(
      program.model, program.replicate(params), dataset,
      config.sample_prompt, num_tokens=config.sample_length,
      rng=program.key(2), max_positions=config.seq_len,
      temperature=config.sample_temperature)
  _say(f'--- sample (temperature {config.sample_temperature}) ---\n'
       f'{sample}\n---')


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str,
    on_evaluation: Callable[[int, dict[str, float]], bool] | None = None,
    on_compiled: Callable[[jax.stages.Compiled], None] | None = None
) -> dict[str, float]:
  """Trains `config` in `workdir`, resuming from its latest checkpoint.

  Returns the final evaluation summary (eval_loss, eval_accuracy, ...).
  `on_evaluation(step, summary)` is called after each evaluation before
  the last step (on every host: its answer must agree); True stops the
  run there after saving a checkpoint, raising Pruned (a sweep's pruner).
  `on_compiled(compiled)` is given each train-step program the run
  compiles (a profile reads its op names).
  The workdir is this run's while it runs (see train/run/workdir.py).
  Raises train.base.errors.InputError, naming the key, for a bad config, a
  workdir in use or one that holds another config;
  TrainingError when non-finite values or a failed save stop the run;
  Stopped when SIGTERM, SIGINT or a preemption notice did, after saving,
  and LeaseLost (a Stopped) when the workdir's lease lapsed or another run
  took it over, before writing again.
  """
  started = time.perf_counter()
  problem = (isinstance(config.get('init_from'), str)
             and init_from.check(config.init_from, workdir))
  if problem:
    raise InputError(problem)
  program = Program.from_config(config)
  init_from.check_fits(program, workdir)
  workdir = storage.resolve(workdir)
  # The config as given is the workdir's record (config.json) and the
  # run's hyperparameters in TensorBoard; the program's is what runs.
  hparams = metrics.flat_hparams(config.to_dict())
  with workdir_lib.claim(config, workdir) as owned:
    # Listening from here on: a stop asked for while the dataset is read or
    # the steps compile is acted on after the first step.
    stop = preemption.StopRequest()
    try:
      return _train(program, workdir, stop, owned, started, on_evaluation,
                    on_compiled, hparams)
    except workdir_lib.LeaseLost as error:
      _say(str(error))
      raise
    finally:
      stop.close()


def _restore_or_init(program: Program,
                     checkpointer: checkpointing.Checkpointer,
                     train_iterator) -> Any:
  """The train state of the latest checkpoint (the iterator restored with
  it), or a fresh one."""
  restored = checkpointer.restore_latest(program.abstract_state,
                                        train_iterator)
  if restored is None:
    if program.config.init_from is None:
      return program.init()
    transferred, said = init_from.load(program.config.init_from, program)
    _say(f'Starting from {said}.')
    return program.start_from(transferred.params)
  latest, state = restored
  if state.opt_state is None:  # A start: an import's parameters.
    _say(f'Starting from the parameters of the checkpoint at step {latest}.')
    return program.start_from(state.params)
  _say(f'Resumed from the checkpoint at step {latest}.')
  note = relaid(checkpointer.saved_mesh(latest), dict(program.mesh.shape))
  if note:
    _say(note)
  return state


def mesh_shown(shape: dict[str, int]) -> str:
  """'data 2 x fsdp 4' of a mesh's {axis: size} ('one device')."""
  return ' x '.join(f'{axis} {size}' for axis, size in shape.items()
                    if size > 1) or 'one device'


def relaid(saved: dict[str, int] | None, mesh: dict[str, int]) -> str | None:
  """The line a resume says where its checkpoint was `saved` from another
  mesh than this run's `mesh` (None where the same, or not known)."""
  if saved is None or mesh_shown(saved) == mesh_shown(mesh):
    return None
  return (f'The checkpoint was saved on {mesh_shown(saved)} and resumes on '
          f'{mesh_shown(mesh)}: from here the run equals one never '
          'interrupted to float32 rounding (its sums run in another order), '
          'not bit for bit, which holds where a run resumes on the layout '
          'it was saved from.')


def calls(first_step: int, last_step: int, steps_per_call: int,
          stops: tuple[int, ...] = ()) -> Iterator[tuple[int, int]]:
  """(the step before, steps) of each call from `first_step` to
  `last_step`: `steps_per_call` steps from each multiple of it, one at a
  time before the first (a run resumed at another steps_per_call), after
  the last, and where a call would cross a step of `stops` (where the
  program changes: config.window_schedule)."""
  step = first_step
  while step < last_step:
    end = min([stop for stop in stops if stop > step] + [last_step])
    count = steps_per_call if (step % steps_per_call == 0 and
                               step + steps_per_call <= end) else 1
    yield step, count
    step += count


def _compile(run, config: TrainConfig, state, batch, dropout_rng,
             writer: metrics.MetricWriter,
             on_compiled: Callable[[jax.stages.Compiled], None] | None
             ) -> None:
  """Compiles `run` (one step, or a call of several) for its first batch
  (the calls reuse it) and checks that it fits in each device's memory."""
  writer.say('Compiling the train step ...')
  compiling = time.perf_counter()
  with jax.profiler.TraceAnnotation('compile'):
    compiled = run.lower(state, batch, dropout_rng).compile()
    config_validation.check_step_fits(compiled, config)
  if on_compiled is not None:
    on_compiled(compiled)
  writer.say(f'Compiled in {time.perf_counter() - compiling:.0f} s.')


def _leave(done: int, checkpointer: checkpointing.Checkpointer,
           stop_reason: str | None) -> None:
  """Once step `done`'s checkpoint is written: Stopped on `stop_reason`,
  else Pruned."""
  checkpointer.wait()
  if stop_reason:
    _say(f'{stop_reason}: saved the checkpoint of step {done} in '
         f'{checkpointer.directory} and stopped; run the same command '
         'to resume.')
    raise Stopped(f'stopped at step {done} on {stop_reason}')
  _say(f'Pruned at step {done}: saved its checkpoint in '
       f'{checkpointer.directory}.')
  raise Pruned(f'pruned at step {done}')


def row_layout(config: TrainConfig) -> str:
  """How a run's rows are laid out (train/data/pipeline.py): streams for a
  Transformer-XL memory, packed windows, or one padded window a row."""
  return ('streams' if config.model.memory_length else
          'packed' if config.pack_sequences else 'padded')


def training_batches(program: Program, dataset: datasets.Dataset):
  """The run's iterator of training batches, this host's rows of each, as
  numpy arrays (its state is what a checkpoint saves beside the train
  state). Batches of a corpus held in memory are made in the loop's own
  thread, a call ahead of the devices: a thread of their own would only
  contend with it for Python's lock. Batches read from files are made
  ahead in a thread, whose reads release it."""
  config = program.config
  return pipeline.train_iterator(
      dataset, seq_len=config.seq_len, batch_size=config.batch_size,
      seed=config.seed, layout=row_layout(config),
      max_segments=config.model.max_segments_per_row,
      rows=program.local_rows,
      prefetch=0 if dataset.shuffle_windows else max(
          pipeline.PREFETCH_BATCHES, config.steps_per_call + 1))


def _train(program: Program, workdir: str, stop: preemption.StopRequest,
           owned: Callable[..., None], started: float,
           on_evaluation: Callable[[int, dict[str, float]], bool] | None,
           on_compiled: Callable[[jax.stages.Compiled], None] | None,
           hparams: dict[str, Any]) -> dict[str, float]:
  """train_and_evaluate of a checked config's program in its claimed
  workdir, `stop` listening; `started`: when the run started
  (time.perf_counter); `hparams`: the config as given, flattened for
  TensorBoard; `owned(confirm=False)`: the check before each write of the
  workdir (workdir.claim's), which raises LeaseLost once the lease lapsed
  or another run took it over."""
  config, model_config = program.config, program.model_config
  dataset = datasets.load(config, workdir)
  config_validation.check_dataset_fits(config, dataset)

  # config.window_schedule's programs, by window (None: the model's own),
  # each evaluated as it trains: an evaluation reads the window of the
  # last step before it.
  stages = {None: program} | {window: program.for_window(window)
                              for _, window in config.window_schedule}
  evaluations_by_window = {
      window: evaluation(config, dataset, stage, workdir, row_layout(config))
      for window, stage in stages.items()}
  evaluate = evaluations_by_window[None]
  checkpointer = checkpointing.Checkpointer(workdir,
                                            keep=config.keep_checkpoints)
  checkpointer.check_space_to_train(program.abstract_state)
  train_iterator = training_batches(program, dataset)
  state = _restore_or_init(program, checkpointer, train_iterator)
  last_step = config.num_train_steps
  first_step = int(state.step)
  _say_what_runs(config, program, workdir, first_step)
  writer = metrics.MetricWriter(workdir, total_steps=last_step,
                                first_step=first_step)
  train_log = _train_log(config, program, writer)
  dropout_rng = program.key(1)

  def call_batches(first: int, last: int):
    """The batch argument of the call of steps `first` to `last` (1-based):
    one batch, or stacked [K, B, ...] (Program.place)."""
    with jax.profiler.TraceAnnotation('next_batch'):
      batches = [next(train_iterator) for _ in range(first, last + 1)]
      if first <= config.debug_poison_step <= last:
        index = config.debug_poison_step - first
        batches[index] = pipeline.poisoned(batches[index])
      return program.place(batches)

  final, evaluations, last_logged, pruned = None, [], {}, False
  lost = False  # Whether LeaseLost stopped the run.
  compiled = set()
  try:
    with program.scope():
      for step, count in calls(first_step, last_step, config.steps_per_call,
                               windows.boundaries(config)):
        done = step + count
        # A call in a jax.profiler trace, numbered by its first step
        # (experiments/profile.py).
        with jax.profiler.StepTraceAnnotation('train', step_num=step + 1):
          batch = call_batches(step + 1, done)
          window = windows.window_at(config, step)
          stage = stages[window]
          run = stage.train_step if count == 1 else stage.train_steps
          if (window, count) not in compiled:  # The calls reuse it.
            # The call before ends first, so that its time stays in its
            # interval and the compilation's does not.
            jax.block_until_ready(state)
            train_log.pause()
            _compile(run, stage.config, state, batch, dropout_rng, writer,
                     on_compiled)
            if compiled:
              train_log.resume()
            else:  # The first throughput figure is that of the steps alone.
              train_log.restart_clock()
            compiled.add((window, count))
          state, step_metrics = run(state, batch, dropout_rng)
          # Waits for the call before this one only: the device has this
          # one queued meanwhile.
          with jax.profiler.TraceAnnotation('train_log'):
            logged = train_log.add(done, step_metrics, count)
            if logged:
              owned()
              writer.write(*logged)
              last_logged = logged[1]
          # After the last step a stop changes nothing: the run is done.
          stopping = stop.due(done) and done < last_step
          # A stop saves at once and leaves the evaluation to the resumed run.
          evaluate_now = (not stopping and
                          metrics.is_due(done, config.eval_every, last_step))
          save_now = stopping or metrics.is_due(done, config.checkpoint_every,
                                                last_step)
          if evaluate_now or save_now:
            logged = train_log.complete()
            train_log.pause()
            summary = logged[1] if logged else {}
            last_logged = summary or last_logged
            if evaluate_now:
              owned()  # It writes the decoded outputs.
              with jax.profiler.TraceAnnotation('evaluate'):
                final = evaluations_by_window[windows.window_at(
                    config, done - 1)](state.params)
              evaluations.append((done, final))
              summary |= final
              pruned = (on_evaluation is not None and done < last_step
                        and on_evaluation(done, final))
              save_now = save_now or pruned
            # A checkpoint asks the store whether the workdir is still
            # this run's, right before it is written; every write after
            # is made within the lease this renews (storage.bounded).
            owned(confirm=save_now)
            if summary:
              writer.write(done, summary)
            if save_now:
              # Every line up to the checkpoint is written before it.
              writer.flush()
              with jax.profiler.TraceAnnotation('checkpoint'):
                checkpointer.save(done, state, train_iterator)
              writer.say(f'step {done}: saving the checkpoint in '
                         f'{checkpointer.directory} (in the background)')
            train_log.resume()
          if stopping or pruned:
            _leave(done, checkpointer, stop.reason if stopping else None)
      if final is None:  # Trained to the end before; evaluate again only.
        final = evaluate(state.params)
    owned()
    writer.write_hparams(hparams, final)
  except metrics.NonFiniteStop as error:
    latest = checkpointer.wait()
    where = ('no checkpoint was saved before it' if latest is None else
             f'the last checkpoint, step {latest} in '
             f'{checkpointer.directory}, is from before it')
    raise TrainingError(f'{error} Stopped; {where}.') from None
  except workdir_lib.LeaseLost:
    lost = True
    raise
  finally:
    train_iterator.close()
    if not lost:  # Else the workdir may be another run's: nothing more.
      unwritten = writer.close()
      checkpointer.close()

  if stop.reason:  # Asked during the final evaluation: trained, done.
    _say(f'{stop.reason}: trained to the end; no sample.')
  # A run trained before sampled at its end; train.generate samples more.
  elif (program.task.continues_text and config.sample_length
        and first_step < last_step):
    _say_a_sample(config, program, dataset, state.params)
  latest = checkpointer.latest_step()
  _say(closing_summary(
      task=program.task, steps=(first_step, last_step),
      seconds=time.perf_counter() - started, evaluations=evaluations,
      final=final, tokens_per_s=last_logged.get('tokens_per_s'),
      checkpoint=None if latest is None else
      f'{checkpointer.directory}/{latest}', workdir=workdir,
      extendable=optim.SCHEDULES[config.schedule].length_free,
      cannot_decode=decoding.cache_refusal(model_config),
      corpus=corpus_line(dataset.corpus_sha256, config.track_corpus)))
  if unwritten:  # Only process 0 writes it: said once all hosts are done.
    raise TrainingError(unwritten)
  return final

