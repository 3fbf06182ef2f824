"""Two JAX processes on localhost train the synthetic task together (CPU, gloo collectives).

Each process sees 2 virtual CPU devices; the (data=2, model=2) mesh spans both processes, so the
train step's collectives cross the process boundary. The processes find each other through the
environment variables `sharding.maybe_initialize_distributed` reads (JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID), the same mechanism as a manual multi-host launch. jax 0.10.2's
CPU client uses gloo for cross-process collectives by default
(`jax_cpu_collectives_implementation='gloo'`).
"""

import json
import os
import socket
import subprocess
import sys

from primal_dual.training import metrics_logging

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, sys
from primal_dual.training import sharding
assert sharding.maybe_initialize_distributed(), 'expected a multi-process launch'
import jax
from primal_dual.training import trainer
sys.path.insert(0, 'tests')  # the working directory is the repository root
from helpers import tiny_config

# The tiny synthetic run, shorter, with a constant learning rate and no regularisation.
config = tiny_config(**{
    'num_train_steps': 6, 'eval_batch_size': 8, 'log_every_steps': 3, 'eval_every_steps': 3,
    'checkpoint_every_steps': 3, 'optimizer.schedule': 'constant', 'optimizer.warmup_steps': 0,
    'optimizer.weight_decay': 0.0, 'optimizer.grad_clip_norm': 0.0})
final = trainer.train_and_evaluate(config, sys.argv[1])
print('RESULT ' + json.dumps({
    'process_index': jax.process_index(), 'process_count': jax.process_count(),
    'devices': jax.device_count(), 'loss': final['train/loss'],
    'test_accuracy': final['test/accuracy']}))
"""


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


def test_two_processes_train_to_the_end_with_the_same_loss(tmp_path):
  workdir = str(tmp_path / "run")
  port = _free_port()
  processes = []
  for process_id in range(2):
    env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS="--xla_force_host_platform_device_count=2",
      JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
      JAX_NUM_PROCESSES="2",
      JAX_PROCESS_ID=str(process_id),
    )
    processes.append(
      subprocess.Popen(
        [sys.executable, "-c", WORKER, workdir],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
      )
    )
  outputs = []
  try:
    for process in processes:
      stdout, stderr = process.communicate(timeout=300)
      outputs.append((process.returncode, stdout, stderr))
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()

  results = []
  for returncode, stdout, stderr in outputs:
    assert returncode == 0, stderr[-3000:]
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, stdout
    results.append(json.loads(lines[0][len("RESULT ") :]))
  assert sorted(r["process_index"] for r in results) == [0, 1]
  assert all(r["process_count"] == 2 and r["devices"] == 4 for r in results)
  assert results[0]["loss"] == results[1]["loss"]
  assert results[0]["test_accuracy"] == results[1]["test_accuracy"]

  # Process 0 alone writes the logs; each process saves its own data-iterator position.
  assert [r["step"] for r in metrics_logging.read_metrics(workdir)] == [3, 6]
  data_files = sorted(os.listdir(os.path.join(workdir, "checkpoints", "6", "data")))
  assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(data_files)
