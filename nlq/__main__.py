from nlq.cli import main

raise SystemExit(main())
