# Vendored from https://github.com/google-deepmind/optax, examples/mlp_mnist.ipynb at commit
# 2edbcbe2390da13983b92cbef94ac0460ecde1c5 (the notebook's code cells, in order, as one script): a flax nnx MLP
# (784-1000-1000-10) trained with `nnx.jit` and an `nnx.Optimizer` (adam).
# Changed for benchmarks/public_programs.py, nothing else:
# - synthetic MNIST-shaped data instead of `tfds.data_source("mnist")` + grain (no network): 40
#   training batches and 5 test batches of 128 uniform images (28, 28, 1) and random labels, from a
#   seeded NumPy generator (the `grain`/`tensorflow_datasets` imports are dropped);
# - `import _bench`; `_bench.tick()` at the top of the training loop's body; `_bench.finish(...)`
#   at the end (final parameters' and optimizer state's checksum, time per step, peak RSS: see
#   _bench.py);
# - expert variant (AUTOOPT_PUBLIC_EXPERT=1): `nnx.jit(donate_argnums=(0, 1))` on train_step
#   (model and optimizer, which nnx updates in place), with `import functools` for it.
# fmt: off
# ruff: noqa
import functools
from typing import Sequence
import jax
import jax.numpy as jnp
import optax
import numpy as np
from flax import nnx

import _bench

# @markdown The learning rate for the optimizer:
LEARNING_RATE = 0.002 # @param{type:"number"}
# @markdown Number of samples in each batch:
BATCH_SIZE = 128 # @param{type:"integer"}
# @markdown Total number of epochs to train for:
N_EPOCHS = 1 # @param{type:"integer"}
# Number of classes (digits 0-9)
N_TARGETS = 10
# Input size (MNIST images are 28x28 pixels)
IMG_SIZE = 28 * 28
# Directory for storing the dataset
DATA_DIR = '/tmp/mnist_dataset'

# benchmark: synthetic data in place of tfds + grain (see the header)
_rng = np.random.default_rng(0)
def _synthetic(n_batches):
    return [
        (_rng.uniform(size=(BATCH_SIZE, 28, 28, 1)).astype(np.float32),
         _rng.integers(0, 10, size=(BATCH_SIZE,)).astype(np.int32))
        for _ in range(n_batches)
    ]
IMG_SIZE = (28, 28, 1)
NUM_CLASSES = 10
train_loader_batched = _synthetic(40)
test_loader_batched = _synthetic(5)

class MLP(nnx.Module):
  """A simple multilayer perceptron model for image classification."""
  def __init__(self, num_inputs: int, num_classes: int, hidden_sizes:
               Sequence[int], *, rngs: nnx.Rngs):
    self.hidden_sizes = hidden_sizes
    self.layer1 = nnx.Linear(num_inputs, self.hidden_sizes[0], rngs=rngs)
    self.layer2 = nnx.Linear(self.hidden_sizes[0], self.hidden_sizes[1],
                             rngs=rngs)
    self.layer_out = nnx.Linear(self.hidden_sizes[1], num_classes, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.layer1(x))
    x = nnx.relu(self.layer2(x))
    x = self.layer_out(x)
    return x

def compute_loss_and_accuracy(model, batch):
    inputs, labels = batch
    logits = model(inputs)

    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=labels
    ).mean()

    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == labels)
    return loss, accuracy

@(functools.partial(nnx.jit, donate_argnums=(0, 1)) if _bench.EXPERT else nnx.jit)
def train_step(model, optimizer, batch):
    """Performs a one step update."""
    grad_fn = nnx.value_and_grad(compute_loss_and_accuracy, has_aux=True)
    (loss, accuracy), grads = grad_fn(model, batch)

    # In-place update of the model parameters
    optimizer.update(model, grads)

    return loss, {"accuracy": accuracy}

@nnx.jit
def eval_step(model, batch):
    loss, accuracy = compute_loss_and_accuracy(model, batch)
    return loss, {"accuracy": accuracy}

def flatten_batches(dataloader):
    """Helper to flatten images to (BATCH_SIZE, 784)."""
    for inputs, labels in dataloader:
        yield inputs.reshape((inputs.shape[0], -1)), labels

rngs = nnx.Rngs(0)

# Create the Model by flattening the tuple IMG_SIZE to an integer
flattened_img_size = int(np.prod(IMG_SIZE))
model = MLP(num_inputs=flattened_img_size, num_classes=N_TARGETS,
            hidden_sizes=[1000, 1000], rngs=rngs)

# Create the Optimizer
solver = optax.adam(LEARNING_RATE)
optimizer = nnx.Optimizer(model, solver, wrt=nnx.Param)

def dataset_stats(model, data_loader):
    """Computes loss and accuracy over the dataset."""
    all_accuracy = []
    all_loss = []
    for batch in data_loader:
        loss, aux = eval_step(model, batch)
        all_loss.append(loss)
        all_accuracy.append(aux["accuracy"])
    return {"loss": np.mean(all_loss), "accuracy": np.mean(all_accuracy)}

train_accuracy = []
train_losses = []
test_accuracy = []
test_losses = []

# Computes test set accuracy at initialization.
test_stats = dataset_stats(model, flatten_batches(test_loader_batched))
test_accuracy.append(test_stats["accuracy"])
test_losses.append(test_stats["loss"])

for epoch in range(N_EPOCHS):
    train_accuracy_epoch = []
    train_losses_epoch = []

    # Iterate over the training dataset
    for step, train_batch in enumerate(flatten_batches(train_loader_batched)):
        _bench.tick()
        train_loss, train_aux = train_step(model, optimizer, train_batch)

        train_accuracy_epoch.append(train_aux["accuracy"])
        train_losses_epoch.append(train_loss)

        if step % 20 == 0:
            print(
                f"Step {step}, train loss: {train_loss:.4f}, train accuracy:"
                f" {train_aux['accuracy']:.2f}")

    # Record training stats
    train_accuracy.append(np.mean(train_accuracy_epoch))
    train_losses.append(np.mean(train_losses_epoch))

    # Evaluate on test set
    test_stats = dataset_stats(model, flatten_batches(test_loader_batched))
    test_accuracy.append(test_stats["accuracy"])
    test_losses.append(test_stats["loss"])

print(f"Improved test accuracy from {test_accuracy[0]:.2f} to {test_accuracy[-1]:.2f}")
_bench.finish((nnx.state(model), nnx.state(optimizer)), train_step, (model, optimizer, train_batch))
