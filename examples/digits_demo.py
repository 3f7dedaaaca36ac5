"""The main demo: digits on 4 CPU workers, worker 0 slowed down 5x, trained with DDP and with prague.

    python examples/digits_demo.py                              # DDP, then strategy="prague", side by side
    python examples/digits_demo.py --strategy partial_reduce    # DDP, then partial_reduce
    python examples/digits_demo.py --baseline none --epochs 8   # prague alone, longer
    python examples/digits_demo.py --help                       # every option

Shows a progress bar per run, then the training time, validation accuracy and batches per worker
of each: the slow worker does far fewer batches under prague, and nobody waits for it.
"""

from lightning_prague.demo.compare import main

if __name__ == "__main__":
    main()
