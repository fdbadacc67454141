"""transformers' Trainer as its users run it, for tests/python/test_trainer.py: the same
script alone (Trainer without conveyor, each step's batch whole) or under `torchrun
--nproc-per-node N` (ConveyorTrainer, each process its DistributedSampler share of the step's
batch). Process 0 (or the single process) writes what Trainer logged and the model's state.

    torchrun --nproc-per-node 2 trainer_worker.py --out two.pt
    python trainer_worker.py --alone 2 --out one.pt
"""
import argparse
import os

import torch

import test_trainer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--alone", type=int, default=0, help="without conveyor, batches as N processes' together")
    args = parser.parse_args()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    net = test_trainer.tiny("gpt2")
    processes = args.alone or int(os.environ["WORLD_SIZE"])
    batch = 4 * processes if args.alone else 4  # a step's batch: the processes' shares together
    # max_grad_norm 0.75: batches of 8 keep their norms under 1, and clipping by the norm
    # across processes is what is shown.
    training = test_trainer.training_args(os.path.dirname(args.out) + "/run", per_device_train_batch_size=batch,
                                          per_device_eval_batch_size=batch, max_grad_norm=0.75)
    trainer = test_trainer.train(net, training, use_conveyor=not args.alone)
    state = trainer.conveyor_model.state_dict() if not args.alone else net.state_dict()  # gathered (collective)
    if trainer.args.process_index == 0:
        torch.save({"logged": test_trainer.logged(trainer), "state": state}, args.out)


if __name__ == "__main__":
    main()
