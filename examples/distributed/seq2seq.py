"""Seed 001's encoder-decoder split: an LSTM encoder on process 0, its decoder on process 1;
the context (h, c) crosses as two tensors, and its gradients come back. No delegate
variable: process 0, which holds no loss, calls conveyor.distributed.backward(); process 1
calls loss.backward() as usual.

    ./run conveyor launch -n 2 -- python examples/distributed/seq2seq.py
    ./run python examples/distributed/seq2seq.py        (the same model in one process)
"""
import torch
import torch.nn as nn

from common import STEPS, arguments, save, split

VOCAB, WIDTH, BATCH, LENGTH = 20, 16, 4, 6


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.lstm = nn.LSTM(WIDTH, WIDTH, batch_first=True)

    def forward(self, source):
        _, (h, c) = self.lstm(self.embed(source))
        return h, c


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.lstm = nn.LSTM(WIDTH, WIDTH, batch_first=True)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, context, target_in, target_out):
        y, _ = self.lstm(self.embed(target_in), context)
        return nn.functional.cross_entropy(self.out(y).flatten(0, 1), target_out.flatten())


def main():
    args = arguments()
    encoder, decoder = Encoder().to(args.device), Decoder().to(args.device)
    data = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randint(VOCAB, (BATCH, LENGTH), generator=data).to(args.device) for _ in range(3))
               for _ in range(STEPS)]
    losses = []
    if not split():
        optimizer = torch.optim.SGD([*encoder.parameters(), *decoder.parameters()], lr=0.5)
        for source, target_in, target_out in batches:
            optimizer.zero_grad()
            loss = decoder(encoder(source), target_in, target_out)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return save(args.out, {"encoder": encoder, "decoder": decoder}, losses)

    import conveyor.distributed as dist
    mine = encoder if dist.rank() == 0 else decoder
    optimizer = torch.optim.SGD(mine.parameters(), lr=0.5)
    for source, target_in, target_out in batches:
        optimizer.zero_grad()
        if dist.rank() == 0:
            dist.send(encoder(source), dst=1)  # (h, c): two tensors in one message
            dist.backward()                     # no loss here: the context's gradient comes back
        else:
            loss = decoder(dist.recv(src=0), target_in, target_out)
            loss.backward()                     # the graph reaches the loss: as usual
            losses.append(loss.item())
        optimizer.step()
    save(args.out, {"encoder" if dist.rank() == 0 else "decoder": mine}, losses, dist.rank())


if __name__ == "__main__":
    main()
