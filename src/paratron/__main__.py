import os
import sys

if "RANK" in os.environ:  # a launched worker ends with its launcher: armed before anything slow
    from paratron.distributed.parent import end_with_launcher

    end_with_launcher(os.getppid())

from paratron.cli import main  # noqa: E402

sys.exit(main())
