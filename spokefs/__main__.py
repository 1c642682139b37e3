from spokefs.cli import main

raise SystemExit(main())
