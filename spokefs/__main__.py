from spokefs.cli.entry import main

raise SystemExit(main())
