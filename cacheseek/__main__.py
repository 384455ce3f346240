"""``python -m cacheseek``: a bare ``--help`` is answered without Hydra (`cacheseek.cli_help`);
everything else is `cacheseek.cli.main`."""

import sys

from cacheseek.cli_help import print_help_if_asked

if __name__ == "__main__" and not print_help_if_asked(sys.argv[1:]):
    from cacheseek.cli import main

    main()
