from hyperloom.cli import main

raise SystemExit(main())
