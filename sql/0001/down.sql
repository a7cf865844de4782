-- lockstep 0001 downgrade: remove everything revision 0001 installed.
-- Triggers created by lockstep.watch() on user tables depend on lockstep.enqueue_trigger and go with it.
drop schema if exists lockstep cascade;
