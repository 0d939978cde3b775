"""``python -m kvstream``: the ``kvstream`` command."""

from kvstream.cli.main import main

if __name__ == "__main__":
    main()
