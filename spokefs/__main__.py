from spokefs.entry import main

raise SystemExit(main())
