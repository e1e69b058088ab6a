"""`python -m keras_hub_autodist`: the `keras-hub-autodist` command.

Example:
```
python -m keras_hub_autodist plan ./gemma_2b --mesh batch=2,model=4
```
"""

import sys

from keras_hub_autodist.cli import main

if __name__ == "__main__":
    sys.exit(main())
