"""The main demo: digits on 4 CPU workers with strategy="prague", worker 0 slowed down 5x.

    python examples/digits_demo.py                 # prague, 4 workers, 4 epochs
    python examples/digits_demo.py --strategy ddp  # the same with Lightning's DDP, for comparison

Prints the validation accuracy and how many batches each worker did: the slow worker does far
fewer, and nobody waits for it.
"""

import torch

from lightning_prague.demo.run import main

if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
