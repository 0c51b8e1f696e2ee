"""``python -m deltarl`` is the same as the ``deltarl`` command."""

from deltarl.cli import main

if __name__ == "__main__":
    main()
